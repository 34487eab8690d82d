"""Every bad input to a command line stops it with one sentence that names the input and says what to do,
and, where the input is a value, before any model loads. One table of cases, each an argv and the
fragment of the message expected, run in-process through each CLI's main(argv). Then the output-folder
rules on the two commands that replace whole folders (nvfp4.py, adapters.py --merge): `--out .`, `--out
SOURCE` and a folder of someone else's files are refused with every file intact, with --force too; and
what --force never deletes, command by command: the home folder, a link's target, a folder holding the
run's data, the project's sources."""
import hashlib
import importlib.util
import json
import os
import shutil

import pytest
import torch

import adapters
import arith
import eval as ev
import hub
import lora
import model as M
import nvfp4
import rollout
import tiny
import train

CLIS = {"train.py": train.main, "eval.py": ev.main, "nvfp4.py": nvfp4.main, "adapters.py": adapters.main,
        "arith.py": arith.main, "tiny.py": lambda argv: tiny.main(tiny.parse_args(argv)), "rollout.py": rollout.main}
SMALL = {"model_type": "qwen2", "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The inputs of the table: copies of the bundled tiny model (one with a truncated weight file, one
    whose config.json disagrees with its weights), an adapter of another model, a file, a user's folder."""
    root = tmp_path_factory.mktemp("inputs")
    tiny_dir = root / "tiny"
    shutil.copytree(hub.ALIASES["tiny"], tiny_dir)
    truncated = root / "truncated"
    shutil.copytree(tiny_dir, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    reshaped = root / "reshaped"
    shutil.copytree(tiny_dir, reshaped)
    config = json.loads((reshaped / "config.json").read_text())
    (reshaped / "config.json").write_text(json.dumps({**config, "intermediate_size": 400}))
    other = M.Transformer.from_random(M.Config(SMALL), dtype=torch.float32)
    lora.apply_lora(other, rank=4, alpha=4)
    adapters.save_adapter(other, root / "other-adapter")
    (root / "a-file").write_text("not a folder")
    (root / "user").mkdir()
    (root / "user" / "thesis.txt").write_text("years of work")
    (root / "empty.jsonl").write_text("")
    words = " ".join(["seven"] * 600)  # (600 tokens and more: longer than the tiny model's 512 positions)
    (root / "long.jsonl").write_text(json.dumps({"question": f"What is {words}?", "answer": "7"}) + "\n")
    (root / "link").symlink_to(root / "user")
    return {"tiny": str(tiny_dir), "truncated": str(truncated), "reshaped": str(reshaped),
            "other_adapter": str(root / "other-adapter"), "file": str(root / "a-file"), "user": str(root / "user"),
            "tmp": str(root), "empty": str(root / "empty.jsonl"), "long": str(root / "long.jsonl"),
            "link": str(root / "link"), "words": words}


no_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
no_tb = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")

# (command, argv, fragment of the message): every value below is refused before a model loads.
BEFORE_LOAD = [
    ("train.py", ["--lr", "nan"], "--lr nan: the peak learning rate must be a finite number > 0"),
    ("train.py", ["--lr=-1e-3"], "--lr -0.001: the peak learning rate must be a finite number > 0"),
    ("train.py", ["--eval-limit", "0"], "--eval-limit 0: must be an integer >= 1"),
    ("train.py", ["--lora-rank", "0"], "--lora-rank 0: must be an integer >= 1"),
    ("train.py", ["--lora-alpha", "inf"], "--lora-alpha inf: LoRA's alpha must be a finite number > 0"),
    ("train.py", ["--lora-targets", "qproj,v_proj"], "--lora-targets qproj,v_proj: qproj matches no linear"),
    ("train.py", ["--lora-targets", ","], "nothing matches no linear of the model; choose among q_proj"),
    ("train.py", ["--max-new-tokens", "0"], "--max-new-tokens 0: must be an integer >= 1"),
    ("train.py", ["--temperature", "nan"], "--temperature nan: the rollout temperature (the logprobs divide by it) must be a finite number > 0"),
    ("train.py", ["--temperature", "0"], "--temperature 0.0: the rollout temperature (the logprobs divide by it) must be a finite number > 0"),
    ("train.py", ["--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    ("train.py", ["--eval-temperature=-1"], "--eval-temperature -1.0: must be a finite number >= 0"),
    ("train.py", ["--group-size", "1"], "group-relative advantages need G >= 2"),
    ("train.py", ["--steps", "0"], "--steps 0: must be an integer >= 1"),
    ("train.py", ["--min-lr-ratio", "2"], "--min-lr-ratio 2.0: must be in [0, 1]"),
    ("train.py", ["--lora-dropout", "1"], "--lora-dropout 1.0: must be in [0, 1)"),
    ("train.py", ["--max-new-tokens", "8", "--overlong-buffer", "9"], "--overlong-buffer 9 must be within"),
    ("train.py", ["--data", "math500"], "--data math500 has no train split (only test); train on arith, gsm8k"),
    ("train.py", ["--data", "nowhere.jsonl"], "no data file at nowhere.jsonl"),
    ("train.py", ["--quant", "bf16", "--fp8-update"], "--fp8-update runs an NVFP4 base's GEMMs in FP8; with --quant bf16"),
    pytest.param("train.py", ["--log", "wandb"], "--log wandb needs the optional package wandb: pip install wandb",
                 marks=no_wandb),
    pytest.param("train.py", ["--log", "tensorboard"], "needs the optional package tensorboard", marks=no_tb),
    ("train.py", ["--device", "gpu0"], "--device gpu0: not a device"),
    ("train.py", ["--model", "no-such-model"], "no model folder at 'no-such-model', and it is not a hub id"),
    ("train.py", ["--resume", "/nonexistent-run"], "cannot resume /nonexistent-run: no args.json in it"),
    ("train.py", ["--out", "."], "--out . is the current folder"),
    ("train.py", ["--out", "{file}/run"], "cannot create --out {file}/run: {file} is a file"),
    ("train.py", ["--out", "{user}"], "holds files that no command of this project wrote (e.g. thesis.txt), which are "
                                      "never deleted, --force or not; name a new or empty folder"),
    ("train.py", ["--out", "{user}", "--force"], "holds files that no command of this project wrote (e.g. thesis.txt)"),
    ("eval.py", ["--limit", "0"], "--limit 0: must be >= 1"),
    ("eval.py", ["--samples", "0"], "--samples 0: must be >= 1"),
    ("eval.py", ["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    ("eval.py", ["--temperature", "nan"], "--temperature nan: must be a number >= 0"),
    ("eval.py", ["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    ("eval.py", ["--out", "{file}/eval"], "cannot create --out {file}/eval: {file} is a file"),
    ("eval.py", ["--out", "{user}"], "holds files that no command of this project wrote"),
    ("eval.py", ["--out", "{user}", "--force"], "holds files that no command of this project wrote"),
    ("eval.py", ["--out", "{link}", "--force"], "--out {link} is a symbolic link (to {user}), which is never followed"),
    ("eval.py", ["--data", "{empty}"], "--data {empty} holds no problems; pass a jsonl file with one problem a line"),
    ("eval.py", ["--data", "{long}"], "--data {long}: its longest prompt has"),
    ("eval.py", ["--data", "{long}"], "tokens and tiny takes 512 positions (max_position_embeddings in its config.json): "
                                      "no room for a completion"),
    ("train.py", ["--max-new-tokens", "10000000"], "--max-new-tokens 10000000: the longest prompt has"),
    ("train.py", ["--eval-max-new-tokens", "10000000"], "--eval-max-new-tokens 10000000: the longest prompt has"),
    ("eval.py", ["--max-new-tokens", "10000000"], "--max-new-tokens 10000000: the longest prompt of --data arith has"),
    ("eval.py", ["--max-new-tokens", "10000000"], "tiny takes 512 positions (max_position_embeddings in its "
                                                  "config.json); pass --max-new-tokens"),
    ("eval.py", ["--data", "arith", "--limit", "1000000000"], "--limit 1000000000: arith's test split gives at most "
                                                              "125125 distinct problems (arith.MAX_SIZE); pass --limit 125125 or less"),
    ("eval.py", ["--data", "arith", "--split", "dev"], "--split dev: arith has the splits train and test"),
    ("rollout.py", ["--model", "tiny", "--prompt", "hi", "--max-new-tokens", "10000000"],
     "--max-new-tokens 10000000: the prompt is"),
    ("rollout.py", ["--model", "tiny", "--prompt", "hi", "--max-new-tokens", "10000000"],
     "tiny takes 512 positions (max_position_embeddings in its config.json); pass --max-new-tokens"),
    ("rollout.py", ["--model", "tiny", "--prompt", "{words}"], "tokens in the chat template and tiny takes 512 positions"),
    ("eval.py", ["--adapter", "{tmp}/none"], "no adapter folder at"),
    ("eval.py", ["--adapter", "{other_adapter}"], "{other_adapter}: adapter layers.0.mlp.down_proj is for a (64, 96) "
                                                  "weight, but this model's is (128, 384); was the adapter trained on another model?"),
    ("eval.py", ["--data", "nowhere"], "'nowhere' is neither a dataset name"),
    ("nvfp4.py", ["--model", "{tiny}", "--out", "."], "--out . is the current folder"),
    ("nvfp4.py", ["--model", "{tiny}", "--out", "{tiny}"], "is the source"),
    ("nvfp4.py", ["--model", "{tiny}", "--out", "{tmp}"], "is a folder holding the source"),
    ("nvfp4.py", ["--model", "{tiny}", "--out", "{user}"], "holds files that no command of this project wrote"),
    ("nvfp4.py", ["--model", "{tiny}", "--out", "{user}", "--force"], "holds files that no command of this project wrote"),
    ("nvfp4.py", ["--model", "{tiny}", "--out", "{link}", "--force"], "--out {link} is a symbolic link"),
    ("nvfp4.py", ["--model", "{tmp}/none", "--out", "{tmp}/q"], "no model folder at"),
    ("adapters.py", ["--merge", "--model", "{tiny}", "--adapter", "{other_adapter}", "--out", "{tmp}/m"],
     "was the adapter trained on another model?"),
    ("adapters.py", ["--merge", "--model", "{tiny}", "--adapter", "{tmp}/none", "--out", "{tmp}/m"], "no adapter folder at"),
    ("tiny.py", ["--out", "{user}"], "holds files that no command of this project wrote"),
    ("tiny.py", ["--out", hub.ALIASES["tiny"]], "lies in the project's own tree"),  # the bundled model, without --force
    ("arith.py", ["--num", "0"], "--num 0: must be in [1, 1125203]"),
    ("arith.py", ["--split", "test", "--num", "1000000000"], "--num 1000000000: must be in [1, 125125]"),
]
# Files that are named when loading them fails (the model loads, so these come after the value checks).
AT_LOAD = [
    ("train.py", ["--model", "{truncated}", "--data", "arith", "--max-new-tokens", "64", "--eval-max-new-tokens", "64",
                  "--out", "{tmp}/run-truncated"],
     "{truncated}/model.safetensors: not a readable safetensors file"),
    ("eval.py", ["--model", "{truncated}", "--out", "{tmp}/eval-truncated"],
     "{truncated}/model.safetensors: not a readable safetensors file"),
    ("eval.py", ["--model", "{reshaped}", "--out", "{tmp}/eval-reshaped"],
     "{reshaped}/model.safetensors: model.layers.0.mlp.gate_proj.weight has shape (384, 128), expected (400, 128)"),
    ("nvfp4.py", ["--model", "{truncated}", "--out", "{tmp}/q-truncated"],
     "{truncated}/model.safetensors: not a readable safetensors file"),
]


def run_cli(prog, argv, files, capsys):
    """The message a CLI stops with (its SystemExit's, or argparse's on stderr)."""
    argv = [a.format(**files) for a in argv]
    with pytest.raises(SystemExit) as e:
        CLIS[prog](argv)
    message = e.value.code if isinstance(e.value.code, str) else capsys.readouterr().err
    assert message.startswith(f"{prog}: ") or "error:" in message, message  # one line of ours, or argparse's
    return message


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A current folder with a file in it, which no command may touch."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("mine")
    yield tmp_path
    assert sorted(os.listdir(tmp_path)) == ["keep.txt"] and (tmp_path / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("prog,argv,fragment", BEFORE_LOAD)
def test_bad_input_is_refused_before_a_model_loads(prog, argv, fragment, files, workdir, capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(M.Transformer, "from_pretrained", no_load)
    monkeypatch.setattr(nvfp4, "_write_quantized", no_load)
    message = run_cli(prog, argv, files, capsys)
    assert fragment.format(**files) in message, message
    assert (os.path.exists(os.path.join(files["user"], "thesis.txt")) and
            sorted(os.listdir(files["user"])) == ["thesis.txt"])


@pytest.mark.parametrize("prog,argv,fragment", AT_LOAD)
def test_a_file_that_fails_to_load_is_named(prog, argv, fragment, files, workdir, capsys):
    assert fragment.format(**files) in run_cli(prog, argv, files, capsys)


def test_arith_help_prints_help(capsys):
    with pytest.raises(SystemExit) as e:
        arith.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage:") and "--split {train,test}" in out


@pytest.mark.parametrize("prog", ["nvfp4.py", "adapters.py"])
def test_out_is_refused_with_every_file_intact(prog, hf_folder, tmp_path, monkeypatch, capsys, tree):
    """`--out .`, `--out SOURCE` and a folder holding a user's file: refused, also with --force, every file
    as it was; another command's output is replaced with --force only; an earlier output of the same
    command is replaced without it; a failure midway leaves the earlier output and no temporary folder."""
    _, src = hf_folder("qwen2")
    adapter = None
    if prog == "adapters.py":
        m = M.Transformer.from_pretrained(src, dtype=torch.float32)
        lora.apply_lora(m, rank=2, alpha=2)
        adapter = adapters.save_adapter(m, tmp_path / "adapter")

    def argv(out, *extra):
        head = ["--merge", "--adapter", adapter] if adapter else []
        return head + ["--model", src, "--out", out, *extra]

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "thesis.txt").write_text("years of work")
    monkeypatch.chdir(cwd)
    before = {d: tree(d) for d in (src, str(cwd), str(tmp_path / "adapter")) if os.path.exists(d)}
    for out, extra, fragment in ((".", [], "is the current folder"), (".", ["--force"], "is the current folder"),
                                 (src, [], "is the source"), (src, ["--force"], "is the source"),
                                 (str(tmp_path), ["--force"], "is a folder holding")):
        with pytest.raises(SystemExit) as e:
            CLIS[prog](argv(out, *extra))
        assert fragment in str(e.value.code), e.value.code
        assert {d: tree(d) for d in before} == before
    if adapter:
        with pytest.raises(SystemExit, match="is the source"):
            CLIS[prog](argv(adapter))
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    for extra in ([], ["--force"]):
        with pytest.raises(SystemExit, match=r"holds files that no command of this project wrote \(e.g. notes.txt\)"):
            CLIS[prog](argv(str(dst), *extra))
        assert tree(dst) == {"notes.txt": hashlib.sha256(b"mine").hexdigest()}
    os.remove(dst / "notes.txt")
    (dst / "summary.json").write_text("{}")
    hub.mark(str(dst), "eval.py", files=["summary.json"])  # another command's output: only with --force
    with pytest.raises(SystemExit, match=f"was written by eval.py, not {prog}; name a new folder, or pass --force"):
        CLIS[prog](argv(str(dst)))
    CLIS[prog](argv(str(dst), "--force"))
    assert "summary.json" not in os.listdir(dst) and "config.json" in os.listdir(dst)
    assert hub.written_by(str(dst)) == prog
    assert os.stat(dst).st_mode & 0o055 == 0o055 & ~os.umask(os.umask(0))  # group/others may read it
    first = tree(dst)
    CLIS[prog](argv(str(dst)))  # an earlier output of the same command: replaced, no --force needed
    assert tree(dst) == first

    def broken(*a, **k):
        raise OSError(28, "disk full")  # (ENOSPC, as a full disk raises it)

    monkeypatch.setattr("safetensors.torch.save_file", broken)
    monkeypatch.setattr(nvfp4, "save_file", broken)
    monkeypatch.setattr(adapters, "save_file", broken)
    with pytest.raises(SystemExit, match="disk full"):
        CLIS[prog](argv(str(dst)))
    assert tree(dst) == first
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".")]
    assert not leftovers, leftovers
    assert {d: tree(d) for d in before} == before


def test_force_deletes_nothing_it_was_not_asked_to(files, tmp_path, monkeypatch, capsys, tree):
    """The cases --force used to delete: the home folder (train.py), a link to it (nvfp4.py: .ssh and all),
    a folder holding the run's own data file (eval.py, train.py), the project's engine sources (nvfp4.py).
    Each is refused with its reason before anything loads, every file of each as it was."""
    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(M.Transformer, "from_pretrained", no_load)
    monkeypatch.setattr(nvfp4, "_write_quantized", no_load)
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("secret")
    monkeypatch.setenv("HOME", str(home))
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    monkeypatch.chdir(work)
    (work / "link").symlink_to(home)
    for split in ("train", "test"):
        (work / "data" / f"{split}.jsonl").write_text("".join(json.dumps({"question": f"What is {i} + 2?", "answer":
                                                                          str(i + 2)}) + "\n" for i in range(4)))
    engine = os.path.join(hub.HERE, "engine")
    before = {d: tree(d) for d in (str(home), str(work), engine)}
    for prog, argv, fragment in (
            ("train.py", ["--out", str(home), "--force"], f"--out {home} is the home folder"),
            ("nvfp4.py", ["--model", files["tiny"], "--out", "link", "--force"], f"--out link is a symbolic link (to {home})"),
            ("eval.py", ["--data", "data/test.jsonl", "--out", "data", "--force"],
             "--out data is a folder holding the source data/test.jsonl"),
            ("train.py", ["--data", "data/train.jsonl", "--eval-data", "data/test.jsonl", "--out", "data", "--force"],
             "--out data is a folder holding the source data/train.jsonl"),
            ("nvfp4.py", ["--model", files["tiny"], "--out", engine, "--force"],
             f"--out {engine} is a folder of the project's own files")):
        message = run_cli(prog, argv, files, capsys)
        assert fragment in message and "\n" not in message, message
        assert {d: tree(d) for d in before} == before


def test_default_outputs_do_not_overwrite_others():
    """eval.py's default folder names the adapter and the quantization (the base's results and an adapter's,
    NVFP4's and bf16's, stay apart);
    tiny.py's default is not the bundled model."""
    base = ev.default_out(ev.parse_args(["--data", "gsm8k"]))
    adapted = ev.default_out(ev.parse_args(["--data", "gsm8k", "--adapter", "runs/x/adapter"]))
    other = ev.default_out(ev.parse_args(["--data", "gsm8k", "--adapter", "runs/y/adapter"]))
    bf16 = ev.default_out(ev.parse_args(["--data", "gsm8k", "--quant", "bf16"]))
    assert base == os.path.join("runs", "eval", "tiny-nvfp4-gsm8k-test") and len({base, adapted, other, bf16}) == 4
    assert "x_adapter" in adapted
    assert os.path.realpath(tiny.parse_args([]).out) != os.path.realpath(hub.ALIASES["tiny"])
