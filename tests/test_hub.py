"""hub.py: where models come from (resolvers, the offline message, stop tokens, devices) and the rules
for output folders (never the current folder, the project, the home folder, an input or a link; a
non-empty folder only when a command of the project wrote it and it holds nothing else: unasked when
this command wrote it, with --force when another did or it lies in the project's tree; permissions of
an ordinary mkdir; no temporary folder left, not even by a killed process)."""
import os
import signal
import stat
import subprocess
import sys
import textwrap

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
                        (PermissionError(13, "Permission denied", "/x"), "p.py: /x: Permission denied"),
                        (OSError("Cannot call rmtree on a symbolic link"), "p.py: Cannot call rmtree on a symbolic link"),
                        (OSError(28, "No space left on device"), "p.py: No space left on device")):
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
    for force in (False, True):  # a folder of someone else's files is never replaced
        with pytest.raises(hub.OutputError, match="holds files that no command of this project wrote "
                                                  r"\(e.g. thesis.txt\), which are never deleted, --force or not"):
            hub.check_out(str(user), "nvfp4.py", force=force)
    assert hub.check_out(str(tmp_path / "new"), "nvfp4.py") == "new"
    ours = tmp_path / "ours"
    ours.mkdir()
    hub.mark(str(ours), "eval.py")
    assert hub.check_out(str(ours), "eval.py") == "ours"
    with pytest.raises(hub.OutputError, match="was written by eval.py, not nvfp4.py; .* pass --force to replace it"):
        hub.check_out(str(ours), "nvfp4.py")
    assert hub.check_out(str(ours), "nvfp4.py", force=True) == "forced"


def test_force_replaces_only_the_files_the_marker_lists(tmp_path):
    """A MARKER that lists its files makes every other file in the folder foreign: the folder is then
    replaced by no one, its own command or --force; a listed name's .tmp twin (a write_json cut short) and
    the MARKER are the project's. A MARKER without a list (a command writing as it goes) covers all."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    (out / "summary.json.tmp").write_text("{")
    hub.mark(str(out), "eval.py", files=["summary.json", "samples.jsonl"])
    assert hub.foreign_entries(str(out)) == []
    assert hub.check_out(str(out), "eval.py") == "ours" and hub.check_out(str(out), "nvfp4.py", force=True) == "forced"
    (out / "notes.txt").write_text("mine")
    assert hub.foreign_entries(str(out)) == ["notes.txt"]
    for prog, force in (("eval.py", False), ("eval.py", True), ("nvfp4.py", True)):
        with pytest.raises(hub.OutputError, match=r"holds files that no command of this project wrote \(e.g. notes.txt\)"):
            hub.check_out(str(out), prog, force=force)
    hub.mark(str(out), "eval.py", run="again")  # marking again keeps the list of files
    assert hub.read_marker(str(out)) == {"written_by": "eval.py", "files": ["samples.jsonl", "summary.json"],
                                         "run": "again"}
    unlisted = tmp_path / "unlisted"
    unlisted.mkdir()
    (unlisted / "anything").write_text("x")
    hub.mark(str(unlisted), "train.py")
    assert hub.foreign_entries(str(unlisted)) == [] and hub.check_out(str(unlisted), "train.py") == "ours"


def test_force_never_touches_home_links_inputs_or_the_project(tmp_path, monkeypatch, tree):
    """What --force never reaches: the home folder (and a folder holding it), a symbolic link (to the home
    folder, to nowhere, a loop; the link and its target stay as they were), a folder holding an input
    (a data file), the project's sources. In the project's tree an earlier output is replaced only with
    --force, even by the command that wrote it."""
    home = tmp_path / "users" / "me"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("secret")
    monkeypatch.setenv("HOME", str(home))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    (work / "to-home").symlink_to(home)
    (work / "nowhere").symlink_to(work / "missing")
    (work / "loop1").symlink_to(work / "loop2")
    (work / "loop2").symlink_to(work / "loop1")
    runs = work / "runs"
    runs.mkdir()
    (runs / "test.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    hub.mark(str(runs), "eval.py")
    before = tree(tmp_path)
    for out, sources, message in (
            (str(home), [], "is the home folder"), (str(home.parent), [], "a folder holding the home folder"),
            ("to-home", [], r"is a symbolic link \(to .*users/me\), which is never followed or replaced"),
            ("to-home/", [], "is a symbolic link"), ("to-home/.", [], "is a symbolic link"),
            ("nowhere", [], "is a symbolic link"),
            ("nowhere/sub", [], "nowhere is a broken symbolic link"), ("loop1/sub", [], "loop1 is a broken symbolic link"),
            ("runs", [str(runs / "test.jsonl")], "is a folder holding the source .*test.jsonl"),
            (os.path.join(hub.HERE, "engine"), [], r"is a folder of the project's own files \(e.g. "),
            (os.path.join(hub.HERE, "tests"), [], "is a folder of the project's own files"),
            (os.path.join(hub.HERE, "assets"), [], "is a folder of the project's own files")):
        for prog in ("nvfp4.py", "eval.py", "train.py"):
            with pytest.raises(hub.OutputError, match=message):
                hub.check_out(out, prog, sources=sources, force=True)
    assert tree(tmp_path) == before
    bundled = hub.ALIASES["tiny"]  # marked as tiny.py's, in the project's tree: tiny.py replaces it only when forced
    assert hub.written_by(bundled) == "tiny.py" and hub.foreign_entries(bundled) == []
    with pytest.raises(hub.OutputError, match="lies in the project's own tree .* pass --force to replace it"):
        hub.check_out(bundled, "tiny.py")
    assert hub.check_out(bundled, "tiny.py", force=True) == "forced"
    assert hub.check_out(os.path.join(hub.HERE, "engine", "new-output"), "nvfp4.py") == "new"  # (nothing made)
    assert not os.path.exists(os.path.join(hub.HERE, "engine", "new-output"))


def test_force_help_says_what_it_does():
    for words in ("another command of this project wrote", hub.MARKER, "nothing but the files that marker lists",
                  "never a folder holding any other file", "symbolic link", "home folder", "current folder",
                  "inputs (model, adapter, data)", "project's own files"):
        assert words in hub.FORCE_HELP, words


def test_claim_folder_empties_only_what_the_project_wrote(tmp_path):
    """claim_folder (eval.py's, train.py's): a new folder is made and marked with the names the command
    writes; an earlier output of the command is emptied first (no stale file beside the new ones); a
    folder with a file the command did not list is refused and keeps it."""
    out = tmp_path / "e"
    assert hub.claim_folder(str(out), "eval.py", files=["summary.json"]) == "new"
    assert os.listdir(out) == [hub.MARKER] and hub.read_marker(str(out))["files"] == ["summary.json"]
    (out / "summary.json").write_text("{}")
    assert hub.claim_folder(str(out), "eval.py", files=["summary.json"]) == "ours"
    assert os.listdir(out) == [hub.MARKER]
    (out / "thesis.txt").write_text("mine")
    with pytest.raises(hub.OutputError, match="thesis.txt"):
        hub.claim_folder(str(out), "eval.py", force=True, files=["summary.json"])
    assert sorted(os.listdir(out)) == [hub.MARKER, "thesis.txt"]


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


def test_new_folder_lists_its_files_and_makes_them_readable(tmp_path):
    """The MARKER lists what the command wrote (so that a file added later is foreign), and files written
    0600 (as safetensors writes them) get an ordinary open's permissions, as the folder an ordinary mkdir's."""
    out = tmp_path / "out"
    with hub.new_folder(str(out), "nvfp4.py") as tmp:
        os.close(os.open(os.path.join(tmp, "model.safetensors"), os.O_WRONLY | os.O_CREAT, 0o600))
        os.mkdir(os.path.join(tmp, "sub"), 0o700)
    mask = os.umask(0)
    os.umask(mask)
    assert hub.read_marker(str(out)) == {"written_by": "nvfp4.py", "files": ["model.safetensors", "sub"]}
    assert stat.S_IMODE(os.stat(out / "model.safetensors").st_mode) == 0o666 & ~mask
    assert stat.S_IMODE(os.stat(out / "sub").st_mode) == 0o777 & ~mask
    assert sorted(os.listdir(out)) == [hub.MARKER, "model.safetensors", "sub"]  # (no lock left behind)


def child(code, **kw):
    """A Python process running `code` with the project importable."""
    env = {**os.environ, "PYTHONPATH": hub.HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, text=True, **kw)


def test_a_killed_writers_temporary_folders_go_with_the_next_run_a_live_writers_stay(tmp_path):
    """SIGKILL runs no cleanup: a process killed inside new_folder leaves its temporary folder beside --out.
    The next new_folder for that --out removes it, since the lock in it is free (its process is dead); it
    leaves the temporary folder of a process still writing (its lock is held), and a look-alike folder
    that holds no lock (nothing proves it a new_folder's). A process killed between moving the earlier
    output aside and renaming the new one into place leaves no --out: the earlier output is moved back."""
    out = str(tmp_path / "out")
    killed = child(f"""
        import os, signal, hub
        with hub.new_folder({out!r}, "nvfp4.py") as tmp:
            open(os.path.join(tmp, "part"), "w").write("half")
            os.kill(os.getpid(), signal.SIGKILL)
        """)
    assert killed.wait() == -signal.SIGKILL
    dead = [n for n in os.listdir(tmp_path) if n.startswith(".out.tmp-")]
    assert len(dead) == 1 and hub.LOCK in os.listdir(tmp_path / dead[0])
    (tmp_path / ".out.tmp-lookalike").mkdir()
    live = child(f"""
        import sys, hub
        with hub.new_folder({out!r}, "nvfp4.py") as tmp:
            open(tmp + "/b", "w").write("live")
            print(tmp, flush=True)
            sys.stdin.readline()
        """, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        live_tmp = live.stdout.readline().strip()
        with hub.new_folder(out, "nvfp4.py") as tmp:
            open(os.path.join(tmp, "a"), "w").write("ours")
        assert sorted(os.listdir(tmp_path)) == sorted([".out.tmp-lookalike", os.path.basename(live_tmp), "out"])
    finally:
        live.communicate("go\n")
    assert live.returncode == 0 and open(os.path.join(out, "b")).read() == "live"  # it finished, unharmed
    assert sorted(os.listdir(tmp_path)) == [".out.tmp-lookalike", "out"]
    between = child(f"""
        import os, signal, hub
        real = os.replace
        def replace(src, dst):  # the earlier output goes aside into .out.old-*/x; die before the new one moves in
            if os.path.basename(src).startswith(".out.tmp-"):
                os.kill(os.getpid(), signal.SIGKILL)
            real(src, dst)
        os.replace = replace
        with hub.new_folder({out!r}, "nvfp4.py") as tmp:
            open(os.path.join(tmp, "c"), "w").write("newer")
        """)
    assert between.wait() == -signal.SIGKILL
    assert not os.path.exists(out) and any(n.startswith(".out.old-") for n in os.listdir(tmp_path))
    assert sorted(os.path.basename(p)[:9] for p in hub.remove_stale(out)) == [".out.old-", ".out.tmp-"]
    assert sorted(os.listdir(tmp_path)) == [".out.tmp-lookalike", "out"] and os.listdir(out) != []
    assert open(os.path.join(out, "b")).read() == "live"  # the earlier output, back in its place


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
