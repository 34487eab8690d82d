"""hub.py: where models come from (resolvers, the offline message, stop tokens, devices) and the rules
for output folders (never the current folder, the project or the source; a non-empty folder only when
this command wrote it, or with --force; permissions of an ordinary mkdir; no temporary folder left)."""
import os
import stat

import pytest
import torch

import hub


def test_offline_hub_id_says_what_to_do(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(RuntimeError, match="`hf download Qwen/Qwen2.5-7B-Instruct --local-dir DIR`"):
        hub.resolve_model_dir("qwen2.5-7b")


def test_a_mistyped_local_path_says_there_is_no_folder_there(monkeypatch, tmp_path):
    """`--model models/qwen7b` (one slash, no such folder) is tried as a hub id, and when that fails the
    error says both: no local folder there, and no hub id. An alias's hub id does not claim a local path."""
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(hub.DownloadError, match="^no local folder at 'models/qwen7b', and could not download hub id "
                                                "'models/qwen7b' from the Hugging Face hub"):
        hub.resolve_model_dir("models/qwen7b")
    with pytest.raises(hub.DownloadError) as e:
        hub.resolve_model_dir("qwen2.5-7b")
    assert str(e.value).startswith("could not download hub id 'Qwen/Qwen2.5-7B-Instruct'")
    assert isinstance(e.value, RuntimeError)  # (what callers caught before it had a class of its own)


def test_stop_on_bad_input_stops_on_bad_input_only():
    """Bad input (a missing file, a malformed one, a model that cannot be fetched, an unreadable path) ends
    in one line `prog: message`; any other RuntimeError is a bug or a failure of the machine, and keeps
    its traceback."""
    for error, line in ((FileNotFoundError("no file x"), "p.py: no file x"), (ValueError("bad x"), "p.py: bad x"),
                        (KeyError("no key x"), "p.py: no key x"), (hub.DownloadError("offline"), "p.py: offline"),
                        (PermissionError(13, "Permission denied", "/x"), "p.py: /x: Permission denied")):
        with pytest.raises(SystemExit) as e:
            with hub.stop_on_bad_input("p.py"):
                raise error
        assert e.value.code == line
    with pytest.raises(RuntimeError, match="a bug"):
        with hub.stop_on_bad_input("p.py"):
            raise RuntimeError("a bug")


def test_stop_token_ids_of_the_bundled_tokenizer():
    """The ids that end a turn (eval, train and rollout's chat share them): eos and Qwen's <|im_end|> /
    <|endoftext|>, each once; a new eos joins them."""
    tok = hub.load_tokenizer("tiny")
    want = {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"), tok.eos_token_id}
    assert hub.stop_token_ids(tok) == sorted(want) and len(want) == 2  # (eos is <|im_end|>)
    tok.add_special_tokens({"eos_token": "<|zz|>"})
    assert hub.stop_token_ids(tok) == sorted(want | {tok.convert_tokens_to_ids("<|zz|>")})


def test_resolve_device():
    """--device: None takes the GPU when there is one; cuda where torch sees none stops with a message
    (not torch's assertion at the first .to()); a name torch does not know, too."""
    assert hub.resolve_device("cpu") == torch.device("cpu")
    assert hub.resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda: .* run with --device cpu"):
            hub.resolve_device("cuda")
    with pytest.raises(SystemExit, match="--device gpu0: not a device"):
        hub.resolve_device("gpu0")


def test_model_keeps_its_resolver_names():
    """model.py re-exports the resolvers for the callers that know them as model's (the public API)."""
    import model

    assert model.resolve_model_dir is hub.resolve_model_dir and model.load_tokenizer is hub.load_tokenizer
    assert model.read_config("tiny")[2].num_layers == 4


def test_check_out_rules(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    for out, message in ((".", "is the current folder"), (str(tmp_path.parent), "a folder holding the current folder"),
                         (str(src), "is the source"), (hub.HERE, "the project's folder")):
        for force in (False, True):  # --force never lifts these
            with pytest.raises(hub.OutputError, match=message):
                hub.check_out(out, "nvfp4.py", sources=[str(src)], force=force)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(hub.OutputError, match="is a file"):
        hub.check_out("a-file", "nvfp4.py")
    with pytest.raises(hub.OutputError, match="cannot create --out a-file/sub: .*a-file is a file"):
        hub.check_out("a-file/sub", "nvfp4.py")
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.txt").write_text("years of work")
    with pytest.raises(hub.OutputError, match="holds files nvfp4.py did not write .*thesis.txt.*--force"):
        hub.check_out(str(user), "nvfp4.py")
    assert hub.check_out(str(user), "nvfp4.py", force=True) == "forced"
    assert hub.check_out(str(tmp_path / "new"), "nvfp4.py") == "new"
    ours = tmp_path / "ours"
    ours.mkdir()
    hub.mark(str(ours), "eval.py")
    assert hub.check_out(str(ours), "eval.py") == "ours"
    with pytest.raises(hub.OutputError, match="was written by eval.py, not nvfp4.py"):
        hub.check_out(str(ours), "nvfp4.py")


def test_new_folder_is_atomic_readable_and_leaves_nothing_on_failure(tmp_path):
    out = tmp_path / "out"
    with hub.new_folder(str(out), "nvfp4.py") as tmp:
        (open(os.path.join(tmp, "a"), "w")).write("1")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o777 & ~mask  # not mkdtemp's 0700
    assert hub.written_by(str(out)) == "nvfp4.py" and (out / "a").read_text() == "1"
    with pytest.raises(RuntimeError, match="boom"):
        with hub.new_folder(str(out), "nvfp4.py") as tmp:
            (open(os.path.join(tmp, "a"), "w")).write("2")
            raise RuntimeError("boom")
    assert (out / "a").read_text() == "1"  # the old output is intact
    assert sorted(os.listdir(tmp_path)) == ["out"]  # and no temporary folder is left
    with hub.new_folder(str(out), "nvfp4.py") as tmp:  # an earlier output of the same command is replaced
        (open(os.path.join(tmp, "b"), "w")).write("3")
    assert sorted(os.listdir(out)) == [hub.MARKER, "b"] and sorted(os.listdir(tmp_path)) == ["out"]


def test_check_tensor_refuses_non_finite_wrong_shape_and_dtype():
    ok = torch.tensor([[1.0, -2.0]])
    assert hub.check_tensor(ok, "w", "f.safetensors", shape=(1, 2), dtype=torch.float32) is ok
    for bad, what in ((torch.tensor([1.0, float("nan")]), "1 non-finite"),
                      (torch.tensor([float("inf")], dtype=torch.bfloat16), "1 non-finite"),
                      (torch.full((2,), float("nan")).to(torch.float8_e4m3fn), "2 non-finite")):
        with pytest.raises(ValueError, match=f"f.safetensors: w holds {what}"):
            hub.check_tensor(bad, "w", "f.safetensors")
    with pytest.raises(ValueError, match=r"shape \(1, 2\), expected \(2, 1\)"):
        hub.check_tensor(ok, "w", "f", shape=(2, 1))
    with pytest.raises(ValueError, match="dtype torch.float32, expected torch.bfloat16"):
        hub.check_tensor(ok, "w", "f", dtype=torch.bfloat16)
    hub.check_tensor(torch.tensor([255], dtype=torch.uint8), "codes", "f")  # (packed codes: no NaN to have)


def test_writing_turns_a_failed_write_into_one_line(tmp_path):
    from safetensors import SafetensorError

    with pytest.raises(hub.OutputError, match=r"cannot write .*a: No space left on device; the old one is kept"):
        with hub.writing(str(tmp_path / "a"), "the old one is kept"):
            raise OSError(28, "No space left on device")
    with pytest.raises(hub.OutputError, match=r"cannot write .*b: .*quota"):
        with hub.writing(str(tmp_path / "b")):
            raise SafetensorError("Error while serializing: quota exceeded")
    with pytest.raises(RuntimeError):  # (anything else is a bug, and keeps its traceback)
        with hub.writing(str(tmp_path / "c")):
            raise RuntimeError("boom")
