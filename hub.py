"""hub.py: where models come from and where outputs go. The bottom of the import graph: it imports
nothing of the project, so every CLI (nvfp4.py, adapters.py, model.py's loaders, train.py, eval.py,
tiny.py) can take its resolvers and its output rules from here without an import circle.

Where models come from. `resolve_model_dir` turns what a user names (a local folder, an alias such as
`tiny` or `qwen2.5-7b`, or a hub id `org/name`) into a local folder with a config.json, downloading
through huggingface_hub (its cache first); offline, the error says how to fetch it elsewhere.

Where outputs go. A command that writes a folder must never destroy what it did not write. The rules
(`check_out`), the same for every CLI:

- `--out` may not be the current folder, the project's folder, the home folder, or an input the command
  reads (the model, the adapter, the data file), nor a folder holding any of them: replacing it would
  delete them. It may not be a symbolic link (replacing what a link points to would reach a folder
  the user never named) or lie beyond a broken one. No flag lifts these.
- A folder that exists and is not empty is replaced only when a command of this project wrote it: it
  carries the marker file MARKER, which names the command and lists the files it wrote there, and holds
  nothing else. A folder holding any other file (a user's, a source of the project) is never deleted,
  with --force or without.
- Such a folder is replaced unasked when this same command wrote it; with `--force` when another
  command wrote it, or when it lies inside the project's own tree (the bundled assets/tiny, an output
  written beside the sources; HERE/runs excepted, the default place for outputs). FORCE_HELP says this
  in every CLI's --help.
- A folder is written under a temporary name beside it and renamed into place when complete
  (`new_folder`), so a crash leaves either the old folder or the new one, and the temporary folder is
  removed on any failure; one that a killed process left (SIGKILL runs no cleanup) is removed by the
  next run into the same --out once a lock in it (flock, released by the OS when its process dies)
  proves its writer dead. Folders and files get the permissions of an ordinary mkdir / open
  (mkdtemp's folders are 0700 and safetensors' files 0600: a serving process run as another user
  could not read them).
- A write that fails for lack of space or permission stops with one line naming the path and what was
  kept (`writing`).
"""
import contextlib
import json
import os
import shutil
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ALIASES = {f"qwen2.5-{n}b": f"Qwen/Qwen2.5-{n.upper()}B-Instruct" for n in ("0.5", "1.5", "3", "7", "14", "32", "72")}
ALIASES["tiny"] = os.path.join(HERE, "assets", "tiny")
MARKER = ".qerl-output.json"  # {"written_by": "nvfp4.py", "files": [...]}: which command wrote its folder, and what


# ---------------------------------------------------------------------------------------------
# Where models come from
# ---------------------------------------------------------------------------------------------

class DownloadError(RuntimeError):
    """A model that is neither a local folder nor fetchable from the hub (offline, a mistyped name): bad
    input, which a CLI reports in one line (stop_on_bad_input), unlike other RuntimeErrors."""


def resolve_model_dir(name_or_path):
    """A local folder, an alias ('qwen2.5-7b', 'tiny') or a hub id → a local folder with config.json.
    Hub ids are fetched with huggingface_hub (from its cache when present); DownloadError when that fails."""
    alias = isinstance(name_or_path, str) and name_or_path.lower() in ALIASES
    target = os.fspath(ALIASES[name_or_path.lower()] if alias else name_or_path)
    if os.path.isdir(target):
        if not os.path.exists(os.path.join(target, "config.json")):
            raise FileNotFoundError(f"{target} has no config.json; is it an HF model folder?")
        return target
    if os.path.sep in target.strip("/").split("/", 1)[-1] or target.startswith((".", "/")) or target.count("/") != 1:
        raise FileNotFoundError(f"no model folder at {target!r}, and it is not a hub id (org/name) or an alias "
                                f"({', '.join(sorted(ALIASES))})")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.jinja", "tokenizer*"]
    try:
        return snapshot_download(target, allow_patterns=patterns, local_files_only=True)
    except Exception:
        pass
    try:
        return snapshot_download(target, allow_patterns=patterns)
    except Exception as e:
        # (a name typed by the user, not an alias, may be a mistyped local path of the same org/name form)
        local = "" if alias else f"no local folder at {target!r}, and "
        raise DownloadError(f"{local}could not download hub id {target!r} from the Hugging Face hub "
                            f"({type(e).__name__}: {e}). If this machine is offline, fetch it elsewhere with "
                            f"`hf download {target} --local-dir DIR`, copy DIR here and pass --model DIR.") from None


def read_config_json(name_or_path):
    """(folder, config.json as a dict) of a model folder, alias or hub id; a malformed file names itself."""
    folder = resolve_model_dir(name_or_path)
    return folder, read_json(os.path.join(folder, "config.json"))


def read_json(path):
    """A JSON object from `path`; a malformed file, or one holding something else, names itself."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def load_tokenizer(name_or_path):
    """The checkpoint's tokenizer (with its chat template), through transformers."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(name_or_path))


def stop_token_ids(tokenizer):
    """Every id that ends a chat turn: eos, and Qwen's <|im_end|> / <|endoftext|> when present."""
    ids = {tokenizer.eos_token_id}
    for t in ("<|im_end|>", "<|endoftext|>"):
        i = tokenizer.convert_tokens_to_ids(t)
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.add(i)
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)


def resolve_device(name=None, prog=None):
    """A CLI's --device → torch.device: None picks cuda when a GPU is visible, else cpu. Asking for cuda
    where torch sees no GPU (a CPU build of torch, or no device), or for a device torch does not know,
    stops with a message (`prog: ...` when given), instead of torch's assertion deep inside the first .to()."""
    import torch

    head = f"{prog}: " if prog else ""
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise SystemExit(f"{head}--device {name}: not a device torch knows; pass cpu or cuda (cuda:N for another "
                         f"GPU)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is a CPU build" if torch.version.cuda is None else "torch sees no CUDA device"
        raise SystemExit(f"{head}--device {name}: {why}; run with --device cpu (or install torch with CUDA on a GPU "
                         f"machine)")
    return device


@contextlib.contextmanager
def stop_on_bad_input(prog):
    """Around a CLI's look at what the user named (model, adapter, data, output folder) and its loading:
    a missing or malformed one (FileNotFoundError, ValueError, KeyError; DownloadError for a model that
    cannot be fetched; OSError for a file that cannot be read or written), whose message names the file
    and says what to do, stops the program with that one line, `prog: message`, instead of a traceback.
    Any other error (a RuntimeError from torch, a bug) keeps its traceback."""
    try:
        yield
    except KeyError as e:  # (str() of a KeyError is its repr: quoted)
        raise SystemExit(f"{prog}: {e.args[0] if e.args else e}") from None
    except (FileNotFoundError, ValueError, DownloadError) as e:
        raise SystemExit(f"{prog}: {e}") from None
    except OSError as e:  # (an OSError raised with a message only has no filename, nor strerror)
        where = f"{e.filename}: " if e.filename else ""
        raise SystemExit(f"{prog}: {where}{e.strerror or e}") from None


# ---------------------------------------------------------------------------------------------
# Where outputs go
# ---------------------------------------------------------------------------------------------

class OutputError(ValueError):
    """An output folder that a command refuses to write (its message says why and what to do)."""


# Every CLI's --force help (eval.py, nvfp4.py, lora.py, tiny.py, train.py): what the flag may and may not do.
FORCE_HELP = ("replace a non-empty --out that this command would not replace unasked: one that another command "
              "of this project wrote (for train.py: an earlier run), or an earlier output inside the project's own "
              f"tree (e.g. assets/tiny). Only a folder holding {MARKER} and nothing but the files that marker "
              "lists is ever replaced; never a folder holding any other file, a symbolic link or what it points "
              "to, the home folder, the current folder, a folder holding this command's inputs (model, adapter, "
              "data), or the project's own files")
LOCK = ".qerl-writing.lock"  # in new_folder's temporary folders: held (flock) by the process writing them


def _inside(path, folder):
    """Whether `path` is `folder` or lies inside it (both real paths)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def read_marker(folder):
    """The fields of `folder`'s MARKER ({} when it has none, or one that is not a JSON object)."""
    try:
        return read_json(os.path.join(folder, MARKER))
    except (OSError, ValueError):
        return {}


def written_by(folder):
    """The command that wrote `folder` (from its MARKER), or None."""
    return read_marker(folder).get("written_by")


def foreign_entries(folder):
    """The entries of `folder` that no command of this project wrote, sorted: all of them when it has no
    readable MARKER (a damaged one included); when its MARKER lists the files the command wrote ("files"), those not listed (a listed name's
    `.tmp` twin, write_json's, and LOCK count as listed); none when the MARKER lists no files (a command
    that writes as it goes and named no files: the folder is its)."""
    entries = sorted(os.listdir(folder))
    marker = read_marker(folder)
    if not marker.get("written_by"):
        return entries
    files = marker.get("files")
    if not isinstance(files, list):
        return []
    ours = {MARKER, LOCK} | {f"{f}{tmp}" for f in [MARKER, *map(str, files)] for tmp in ("", ".tmp")}
    return [e for e in entries if e not in ours]


def _homes():
    homes = {os.path.expanduser("~")}
    try:
        import pwd

        homes.add(pwd.getpwuid(os.getuid()).pw_dir)
    except (ImportError, KeyError):
        pass
    return sorted(os.path.realpath(h) for h in homes if h and h != "~")


def check_out(out, prog, sources=(), force=False):
    """Raise OutputError unless `prog` may write the folder `out` (the rules in the module docstring).
    sources: what the command reads (a model folder, an adapter, a data file), which `out` may neither be
    nor hold. Returns "new" (nothing there or an empty folder), "ours" (written by prog before, replaced
    unasked) or "forced" (a folder only force lets prog replace)."""
    if not out:
        raise OutputError("the output folder is empty; pass a folder name with --out")
    suggest = f"name a new folder, e.g. --out runs/{prog.removesuffix('.py')}-out"
    plain = os.path.abspath(out)
    if os.path.islink(plain):
        raise OutputError(f"--out {out} is a symbolic link (to {os.readlink(plain)}), which is never followed or "
                          f"replaced, --force or not; name the folder itself, or a new one")
    up = plain
    while not os.path.lexists(up):
        up = os.path.dirname(up)
    if not os.path.exists(up):  # (lexists but not exists: a link to nowhere, or a loop of links)
        raise OutputError(f"cannot create --out {out}: {up} is a broken symbolic link (it points to "
                          f"{os.readlink(up)!r}, which does not exist); {suggest}")
    real = os.path.realpath(out)
    never = [(os.getcwd(), "the current folder"), (HERE, "the project's folder")]
    never += [(h, "the home folder") for h in _homes()]
    never += [(s, f"the source {s}") for s in sources if s]
    for path, what in never:
        if _inside(os.path.realpath(path), real):
            what = what if os.path.realpath(path) == real else f"a folder holding {what}"
            raise OutputError(f"--out {out} is {what}, which writing there would replace; {suggest}")
    if os.path.exists(real) and not os.path.isdir(real):
        raise OutputError(f"--out {out} is a file, not a folder; name a folder")
    parent = real
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise OutputError(f"cannot create --out {out}: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write --out {out}: no permission to write in {parent}; choose another folder")
    entries = sorted(os.listdir(real)) if os.path.isdir(real) else []
    if not entries:
        return "new"
    here = os.path.realpath(HERE)
    project = _inside(real, here) and not _inside(real, os.path.join(here, "runs"))
    foreign = foreign_entries(real)
    if foreign:
        if project:
            raise OutputError(f"--out {out} is a folder of the project's own files (e.g. {foreign[0]}), which no "
                              f"command replaces, --force or not; {suggest}")
        raise OutputError(f"--out {out} holds files that no command of this project wrote (e.g. {foreign[0]}), "
                          f"which are never deleted, --force or not; name a new or empty folder, or move them out")
    owner = written_by(real)
    if project:  # (the bundled assets/tiny, an output written beside the sources): only when named with --force
        if force:
            return "forced"
        raise OutputError(f"--out {out} lies in the project's own tree ({HERE}) and holds what {owner} wrote "
                          f"there, replaced only with --force; pass --force to replace it, or {suggest}")
    if owner == prog:
        return "ours"
    if force:
        return "forced"
    raise OutputError(f"--out {out} is not empty and was written by {owner}, not {prog}; name a new folder, or "
                      f"pass --force to replace it")


def normal_permissions(path):
    """Give a folder made by mkdtemp (0700) the permissions an ordinary mkdir would (0777 less the umask),
    and every file and folder in it those of an ordinary open / mkdir (safetensors writes its files 0600:
    a serving process run as another user could not read them)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o777 & ~mask)
    for d, dirs, names in os.walk(path):
        for n in dirs:
            if not os.path.islink(os.path.join(d, n)):
                os.chmod(os.path.join(d, n), 0o777 & ~mask)
        for n in names:
            if not os.path.islink(os.path.join(d, n)):
                os.chmod(os.path.join(d, n), 0o666 & ~mask)


def mark(folder, prog, files=None, **info):
    """Write the MARKER that lets `prog` recognise `folder` as its own output later, and lets --force
    replace it: `files`, the names prog writes there (top level), makes anything else in the folder
    foreign (foreign_entries). files None keeps the list an earlier MARKER of prog's holds (a command that
    marks its folder again with new info, as train.py does); info: any other fields."""
    old = read_marker(folder)
    if files is None and old.get("written_by") == prog:
        files = old.get("files")
    write_json(os.path.join(folder, MARKER),
               {"written_by": prog, **({"files": sorted(files)} if files is not None else {}), **info})


def _hold_lock(folder, prog):
    """Create LOCK in `folder` already flock-ed by this process (made under another name and renamed, so
    no one sees it unlocked), with who holds it for a reader. The returned file keeps the lock until it is
    closed or the process dies, however it dies: a later run tells a dead writer's folder from a live one."""
    try:
        import fcntl
    except ImportError:  # (no flock on this system: nothing will prove the folder's writer dead)
        return None
    fd, tmp = tempfile.mkstemp(prefix=".lock-", dir=folder)
    f = os.fdopen(fd, "w")
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    f.write(json.dumps({"pid": os.getpid(), "written_by": prog}) + "\n")
    f.flush()
    os.replace(tmp, os.path.join(folder, LOCK))
    return f


def _dead_writer(folder):
    """The open LOCK of `folder`, flock-ed by us, when the process that made it is gone; None when it is
    alive, or when nothing proves the folder was ours (no LOCK: e.g. a writer between mkdtemp and its lock)."""
    try:
        import fcntl

        f = os.fdopen(os.open(os.path.join(folder, LOCK), os.O_RDWR))  # (never created here: no LOCK, no proof)
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its writer is alive
        f.close()
        return None
    return f


def remove_stale(out):
    """Remove what a killed new_folder left beside `out`: its temporary folders (.<name>.tmp-*, a partial
    output) and the folders an earlier output was moved aside into (.<name>.old-*), each only when its LOCK
    proves that a new_folder made it and that the process is dead. An earlier output left aside with no
    `out` in its place (killed between the two renames) is moved back. Returns the paths removed."""
    real = os.path.realpath(out)
    parent, base = os.path.dirname(real), os.path.basename(real)
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(parent, name)
        if not name.startswith((f".{base}.tmp-", f".{base}.old-")) or os.path.islink(path) or not os.path.isdir(path):
            continue
        lock = _dead_writer(path)
        if lock is None:
            continue
        try:
            aside = os.path.join(path, "x")
            if ".old-" in name[len(base) + 1:] and os.path.isdir(aside) and not os.path.lexists(real):
                os.replace(aside, real)
            shutil.rmtree(path)
            removed.append(path)
        except OSError:
            pass  # (not ours to remove after all, e.g. another user's: left as it is)
        finally:
            lock.close()
    return removed


@contextlib.contextmanager
def new_folder(out, prog, sources=(), force=False):
    """Write a whole output folder atomically: `with new_folder(out, "nvfp4.py", [src]) as tmp:` fill
    tmp; on success it is marked as prog's (with the files it holds) and renamed to `out` (replacing what
    check_out allowed), on any failure it is removed and `out` is left as it was. A temporary folder that
    a killed earlier run left beside `out` is removed first (remove_stale). A write of its own that fails
    (full disk, no permission) is one OutputError line (writing)."""
    remove_stale(out)
    check_out(out, prog, sources, force)
    real = os.path.realpath(out)
    parent = os.path.dirname(real)
    kept = f"{out} is as it was" if os.path.exists(real) else f"nothing was written to {out}"
    with writing(out, kept):
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(real)}.tmp-", dir=parent)
    locks = []
    try:
        with writing(out, kept):
            locks.append(_hold_lock(tmp, prog))
        yield tmp
        with writing(out, kept):
            normal_permissions(tmp)
            mark(tmp, prog, files=[n for n in os.listdir(tmp) if n not in (MARKER, LOCK)])
            old = None
            if os.path.exists(real):
                old = tempfile.mkdtemp(prefix=f".{os.path.basename(real)}.old-", dir=parent)
                locks.append(_hold_lock(old, prog))
                os.replace(real, os.path.join(old, "x"))  # aside, then removed once the new one is in place
            try:
                os.replace(tmp, real)
            except OSError:
                if old:
                    os.replace(os.path.join(old, "x"), real)
                raise
            if old:
                shutil.rmtree(old, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(os.path.join(real, LOCK))
    finally:
        for f in locks:
            if f is not None:
                f.close()
        shutil.rmtree(tmp, ignore_errors=True)  # (gone already after a success)


def claim_folder(out, prog, sources=(), force=False, files=None):
    """For a command that writes into its folder as it goes (train.py, eval.py): check `out` (check_out),
    empty it when check_out allowed replacing it ("ours": an earlier output of prog's, or "forced"),
    create it and mark it as prog's. files: the names prog will write there (mark), so that anything else
    found there later is never deleted. Returns check_out's answer."""
    state = check_out(out, prog, sources, force)
    if state != "new" and os.path.isdir(out):
        shutil.rmtree(out)  # (check_out found only what the project wrote there)
    os.makedirs(out, exist_ok=True)
    mark(out, prog, files=files)
    return state


@contextlib.contextmanager
def writing(path, kept=None):
    """Around a write: one that fails for lack of space or permission (an OSError, or the SafetensorError
    that safetensors raises for the same causes) becomes one OutputError line naming `path`, the cause,
    and `kept` (what is still there: "the checkpoint before it is kept", say), which stop_on_bad_input
    prints instead of a traceback."""
    try:
        yield
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}" + (f"; {kept}" if kept else "")) from None
    except Exception as e:
        if type(e).__name__ != "SafetensorError":  # (safetensors' own class; it is no OSError)
            raise
        raise OutputError(f"cannot write {path}: {e}" + (f"; {kept}" if kept else "")) from None


def check_tensor(t, name, path, shape=None, dtype=None):
    """A tensor read from a file, refused (ValueError naming the file and the tensor) unless it is finite
    and, where given, of `shape` and `dtype`: a NaN weight would otherwise run silently to NaN outputs.
    Integer and packed tensors (NVFP4 codes) are always finite; float8 is checked through float32."""
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{path}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{path}: {name} has dtype {t.dtype}, expected {dtype}")
    if t.is_floating_point():
        bad = ~(t.float() if t.element_size() == 1 else t).isfinite()
        if bool(bad.any()):
            raise ValueError(f"{path}: {name} holds {int(bad.sum())} non-finite values (NaN or infinity) of "
                             f"{t.numel()}; the file is damaged or was written by a diverged run")
    return t


def write_text(path, text):
    """Write a text file atomically: a reader (or a crash) sees the old file or the new, never half of one; a
    write that fails (a full disk) leaves no temporary file."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_json(path, obj):
    """Write JSON atomically (write_text)."""
    write_text(path, json.dumps(obj, indent=2))
