"""data.py: the named sets read from the shared test data and from the hub's own file layouts (offline
fixtures), plain jsonl files and their field forms, limits, malformed and non-UTF-8 files, the offline
errors and the download cache."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import data  # noqa: E402
import tasks  # noqa: E402

DATA = REPO.parent / "shared" / "data"  # the project's shared test data, next to the repo
needs_data = pytest.mark.skipif(not (DATA / "gsm8k" / "test.jsonl").exists(), reason=f"no test data at {DATA}")
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hub"


@needs_data
@pytest.mark.parametrize("name, n, kind", [("gsm8k", 1319, "gsm8k"), ("math500", 500, "math"),
                                           ("aime24", 30, "math"), ("amc23", 40, "math")])
def test_named_datasets_from_shared_data(name, n, kind):
    items = data.load_dataset(name, "test", data_dir=DATA)
    assert len(items) == n
    raw = [json.loads(line) for line in open(DATA / name / "test.jsonl")]
    for it, r in zip(items, raw):
        assert it["kind"] == kind and it["question"] == r.get("question", r.get("problem"))
        assert it["answer"] and isinstance(it["answer"], str)
    if name == "math500":
        assert {"level", "subject", "id", "solution"} <= set(items[0])
        assert [it["level"] for it in items] == [r["level"] for r in raw]
        assert [it["answer"] for it in items] == [r["answer"] for r in raw]
    if name in ("aime24", "amc23"):  # integer answers (amc23 stores 27.0, aime24 writes 025)
        for it, r in zip(items, raw):
            assert "." not in it["answer"] and int(it["answer"]) == float(r["answer"])
            assert tasks.grade("math", f"\\boxed{{{int(it['answer'])}}}", it["answer"])
            assert not tasks.grade("math", f"\\boxed{{{int(it['answer']) + 1}}}", it["answer"])
    assert data.load_dataset(name, "test", limit=7, data_dir=DATA) == items[:7]


@needs_data
def test_gsm8k_train_split_and_env_var(monkeypatch):
    monkeypatch.setenv("QERL_DATA", str(DATA))
    assert data.dataset_path("gsm8k", "train") == DATA / "gsm8k" / "train.jsonl"
    train = data.load_dataset("gsm8k", "train")
    assert len(train) == 7473 and all(it["kind"] == "gsm8k" for it in train)
    with pytest.raises(ValueError, match="splits"):
        data.load_dataset("math500", "train")


def test_plain_jsonl_fields(tmp_path):
    rows = [
        {"question": "Q1", "answer": "He has 3.\n#### 3"},                       # gsm8k style
        {"problem": "Q2", "answer": "\\frac{1}{2}", "level": 3, "subject": "Algebra"},
        {"problem": "Q3", "solution": "It is $\\boxed{\\{1,2\\}}$."},             # gold from the solution
        {"prompt": "Q4", "solution": "2+2=4\n#### 4"},
        {"question": "Q5", "answer": 12, "kind": "gsm8k"},                        # a number; kind given
        {"question": "Q6", "answer": 2.0},
    ]
    path = tmp_path / "mine.jsonl"
    lines = [json.dumps(r) for r in rows]
    path.write_text("\n".join(lines[:3] + [""] + lines[3:]))  # with a blank line
    items = data.load_dataset(str(path))
    assert [(it["question"], it["answer"], it["kind"]) for it in items] == [
        ("Q1", "3", "gsm8k"), ("Q2", "\\frac{1}{2}", "math"), ("Q3", "\\{1,2\\}", "math"),
        ("Q4", "4", "gsm8k"), ("Q5", "12", "gsm8k"), ("Q6", "2", "math")]
    assert items[0]["solution"] == rows[0]["answer"] and items[1]["level"] == 3
    assert tasks.grade(items[2]["kind"], "\\boxed{\\{2, 1\\}}", items[2]["answer"])
    assert len(data.load_dataset(path, limit=2)) == 2


def test_a_negative_limit_is_refused(tmp_path, monkeypatch, capsys):
    """records[:-1] would drop the last record without a word: a negative limit is an error, from a file
    and from the generated set alike, and the CLI says so; 0 keeps nothing, None everything."""
    path = tmp_path / "few.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"Q{i}", "answer": str(i)}) for i in range(3)))
    for name in (path, "arith"):
        with pytest.raises(ValueError, match="limit must be a whole number >= 0"):
            data.load_dataset(name, limit=-1)
        assert data.load_dataset(name, limit=0) == []
    with pytest.raises(ValueError, match="limit must be"):
        data.read_jsonl(path, limit=-2)
    assert len(data.load_dataset(path)) == 3
    monkeypatch.setattr(sys, "argv", ["data.py", "--data", str(path), "--limit", "-1"])
    with pytest.raises(SystemExit):
        data.main()
    assert "--limit -1: must be >= 1" in capsys.readouterr().err


def test_malformed_lines_are_reported_with_line_numbers(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([
        json.dumps({"question": "ok", "answer": "1"}),
        "",
        '{"question": "broken", "answer": ',                    # line 3: invalid JSON
        json.dumps({"question": "ok", "answer": "2"}),
        json.dumps({"answer": "3"}),                            # line 5: no question
        json.dumps(["not", "an", "object"]),                    # line 6
        json.dumps({"question": "no answer"}),                  # line 7
        json.dumps({"question": "q", "answer": "1", "kind": "poetry"}),  # line 8
    ]) + "\n")
    with pytest.raises(ValueError) as e:
        data.load_dataset(str(path))
    msg = str(e.value)
    assert "5 malformed line(s)" in msg
    for line, why in [(3, "invalid JSON"), (5, "no question"), (6, "expected a JSON object"), (7, "no answer"),
                      (8, "unknown kind")]:
        assert f"{path}:{line}: {why}" in msg
    for line in (1, 2, 4):
        assert f"{path}:{line}:" not in msg


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path, monkeypatch):
    """A Latin-1 file (an editor's default elsewhere): one line naming the file, the line and the byte,
    from read_jsonl, load_dataset, the CLI, and eval.py before any model loads."""
    path = tmp_path / "latin1.jsonl"
    good = json.dumps({"question": "2 + 2?", "answer": "4"}) + "\n"
    path.write_bytes(good.encode() + '{"question": "Caf\u00e9 costs 3 + 4?", "answer": "7"}\n'.encode("latin-1"))
    want = f"{path}:2: not UTF-8 text (byte 0xe9 at byte 18 of the line); save the file as UTF-8"
    for load in (data.read_jsonl, data.load_dataset):
        with pytest.raises(ValueError) as e:
            load(path)
        assert str(e.value) == want
    with pytest.raises(SystemExit) as e:
        data.main(["--data", str(path)])
    assert str(e.value) == f"data.py: {want}"
    import eval as ev
    with pytest.raises(SystemExit) as e:
        ev.main(["--data", str(path), "--out", str(tmp_path / "e")])
    assert str(e.value) == f"eval.py: {want}" and not (tmp_path / "e").exists()
    # The same text in UTF-8 reads, accents and all.
    path.write_text(good + json.dumps({"question": "Caf\u00e9 costs 3 + 4?", "answer": "7"}, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    assert [it["question"] for it in data.read_jsonl(path)] == ["2 + 2?", "Caf\u00e9 costs 3 + 4?"]


def test_cli_shows_the_size_and_one_prompt(tmp_path, capsys):
    path = tmp_path / "two.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in (3, 4)))
    data.main(["--data", str(path)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}/test: 2 items, kind math"
    assert out[1] == "What is 3 + 3?" and out[2] == tasks.MATH_INSTRUCTION and out[3] == "gold: 6"


def test_offline_without_a_file_names_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as e:
        data.load_dataset("gsm8k", "test", data_dir=tmp_path)
    want = str(tmp_path / "gsm8k" / "test.jsonl")
    assert want in str(e.value) and "offline" in str(e.value)

    monkeypatch.delenv("HF_HUB_OFFLINE")

    def no_network(source, split):
        raise OSError("[Errno -2] Name or service not known")
    monkeypatch.setattr(data, "_fetch", no_network)
    with pytest.raises(FileNotFoundError) as e:
        data.load_dataset("math500", data_dir=tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "math500" / "test.jsonl") in msg and "HuggingFaceH4/MATH-500" in msg
    assert "Name or service not known" in msg
    with pytest.raises(FileNotFoundError, match="neither a dataset name"):
        data.load_dataset(str(tmp_path / "missing.jsonl"))


def test_download_picks_the_split_file_and_caches_it(tmp_path, monkeypatch):
    import huggingface_hub
    hub = tmp_path / "hub"
    hub.mkdir()
    rows = [{"problem": "P1", "solution": "s \\boxed{2}", "answer": "2", "subject": "Algebra", "level": 1,
             "unique_id": "a"},
            {"problem": "P2", "solution": "s \\boxed{x}", "answer": "x", "subject": "Algebra", "level": 5,
             "unique_id": "b"}]
    (hub / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files",
                        lambda self, repo_id, repo_type=None, **kw: ["README.md", ".gitattributes", "test.jsonl"])

    def fake_download(repo_id, filename, repo_type=None, **kw):
        calls.append((repo_id, filename, repo_type))
        return str(hub / filename)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cache = tmp_path / "cache"
    items = data.load_dataset("math500", data_dir=cache)
    assert calls == [("HuggingFaceH4/MATH-500", "test.jsonl", "dataset")]
    assert [(it["question"], it["answer"], it["level"], it["id"]) for it in items] == [
        ("P1", "2", 1, "a"), ("P2", "x", 5, "b")]
    assert (cache / "math500" / "test.jsonl").exists()
    monkeypatch.setattr(data, "_fetch", lambda *a: pytest.fail("cached file not used"))
    assert data.load_dataset("math500", data_dir=cache) == items


def test_pick_files_for_hub_layouts():
    gsm = data.DATASETS["gsm8k"][1]
    files = ["README.md", "main/test-00000-of-00001.parquet", "main/train-00000-of-00001.parquet",
             "socratic/test-00000-of-00001.parquet"]
    assert data._pick_files(files, gsm, "test") == ["main/test-00000-of-00001.parquet"]
    aime = data.DATASETS["aime24"][1]
    assert aime.splits["test"] == "train"
    assert data._pick_files(["data/train-00000-of-00001.parquet"], aime, "train") == [
        "data/train-00000-of-00001.parquet"]
    amc = data.DATASETS["amc23"][1]
    assert data._pick_files(["test/0000.parquet", "test.jsonl", "testing.jsonl"], amc, "test") == ["test.jsonl"]
    with pytest.raises(FileNotFoundError):
        data._pick_files(["README.md"], amc, "test")


def test_arith_dataset_is_graded_as_gsm8k():
    arith = pytest.importorskip("arith")
    items = data.load_dataset("arith", "test", limit=25)
    assert len(items) == 25 and all(it["kind"] == "gsm8k" for it in items)
    raw = arith.load("test", n=25)
    for it, r in zip(items, raw):
        assert it["question"] == r["question"] and it["solution"] == r["answer"]
        assert it["answer"] == str(arith.parse_solution(r["answer"])[1])
        assert tasks.grade("gsm8k", r["answer"], it["answer"])
        assert not tasks.grade("gsm8k", f"#### {int(it['answer']) + 1}", it["answer"])


# ------------------------------------------------------------------------------------------------
# The paper's training sets, from the hub's file layout (offline fixtures)
# ------------------------------------------------------------------------------------------------

def fixture_rows(name):
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """A local stand-in for the Hugging Face Hub: repo id -> {file in the repo: rows}, written as the
    parquet files the hub serves; list_repo_files and hf_hub_download read them."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    import huggingface_hub

    repos, calls = {}, []

    def add(repo_id, files):
        for rel, rows in files.items():
            path = tmp_path / "hub" / repo_id / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(rows), path)
        repos.setdefault(repo_id, []).extend(files)

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files",
                        lambda self, repo_id, repo_type=None, **kw: ["README.md", *repos[repo_id]])

    def download(repo_id, filename, repo_type=None, **kw):
        calls.append((repo_id, filename))
        return str(tmp_path / "hub" / repo_id / filename)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return add, calls


def test_bigmath_from_the_hub_layout(fake_hub, tmp_path):
    add, calls = fake_hub
    rows = fixture_rows("big_math_rl_verified_processed.jsonl")
    add("open-r1/Big-Math-RL-Verified-Processed", {
        "level_3_4_5/train-00000-of-00002.parquet": rows[:2], "level_3_4_5/train-00001-of-00002.parquet": rows[2:],
        "level_4_5/train-00000-of-00001.parquet": rows[1:2], "all/train-00000-of-00001.parquet": rows})
    items = data.load_dataset("bigmath", "train", data_dir=tmp_path / "cache")
    assert calls == [("open-r1/Big-Math-RL-Verified-Processed", f"level_3_4_5/train-0000{i}-of-00002.parquet")
                     for i in range(2)]
    kept = [r for r in rows if len(r["prompt"]) <= 1024]  # the official filter drops the long one
    assert len(kept) == 3 < len(rows)
    assert [(it["question"], it["answer"], it["kind"], it["subject"]) for it in items] == [
        (r["prompt"], r["solution"], "math", r["source"]) for r in kept]
    # The cache keeps the hub's raw rows, so the filter and field map apply again on every read.
    cached = [json.loads(line) for line in (tmp_path / "cache" / "bigmath" / "train.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in cached] == [r["prompt"] for r in rows]
    # Graded with math-verify: an equivalent form of each gold answer is right, a different one wrong.
    for it, equal in zip(items, ["0.875", "3, -3", "4\\pi"]):
        assert tasks.grade("math", f"... \\boxed{{{equal}}}", it["answer"], strict=True), (it["answer"], equal)
        assert not tasks.grade("math", "... \\boxed{5}", it["answer"], strict=True)
    hard = data.load_dataset("bigmath-hard", "train", data_dir=tmp_path / "cache")
    assert [it["question"] for it in hard] == [rows[1]["prompt"]]
    with pytest.raises(ValueError, match="splits \\['train'\\]"):
        data.load_dataset("bigmath", "test", data_dir=tmp_path / "cache")


def test_dapo_math_from_the_hub_layout(fake_hub, tmp_path):
    add, calls = fake_hub
    rows = fixture_rows("dapo_math_17k_processed.jsonl")
    add("open-r1/DAPO-Math-17k-Processed", {"en/train-00000-of-00001.parquet": rows,
                                            "cn/train-00000-of-00001.parquet": rows[:1]})
    items = data.load_dataset("dapo-math", "train", data_dir=tmp_path / "cache", limit=5)
    assert calls == [("open-r1/DAPO-Math-17k-Processed", "en/train-00000-of-00001.parquet")]
    assert len(items) == 2  # the third prompt is over the official 1024 characters
    assert items[0]["question"] == "How many positive divisors does $36$ have?"  # DAPO's wrapper removed
    assert [(it["answer"], it["id"], it["kind"]) for it in items] == [("9", "a1b2", "math"), ("12", "c3d4", "math")]
    assert "Answer:" not in tasks.get_task("math").messages(items[1]["question"])[0]["content"]
    assert tasks.grade("math", "so \\boxed{12}", items[1]["answer"], strict=True)


@pytest.mark.parametrize("name, repo", [("bigmath", "open-r1/Big-Math-RL-Verified-Processed"),
                                        ("dapo-math", "open-r1/DAPO-Math-17k-Processed")])
def test_offline_without_the_files_says_how_to_get_them(tmp_path, monkeypatch, name, repo):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as e:
        data.load_dataset(name, "train", data_dir=tmp_path)
    msg = str(e.value)
    assert str(tmp_path / name / "train.jsonl") in msg and "offline" in msg
    assert repo in msg and f"python data.py --data {name} --split train" in msg


def test_hand_written_cache_in_the_hub_schema(tmp_path):
    """The file the error message asks for: the hub's rows as jsonl, read through the same map."""
    (tmp_path / "bigmath").mkdir()
    rows = fixture_rows("big_math_rl_verified_processed.jsonl")
    (tmp_path / "bigmath" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = data.load_dataset("bigmath", "train", data_dir=tmp_path, limit=2)
    assert [it["answer"] for it in items] == ["\\frac{7}{8}", "\\pm 3"]
