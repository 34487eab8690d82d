"""hub.py: where models come from and where outputs go. The bottom of the import graph: it imports
nothing of the project, so every CLI (nvfp4.py, adapters.py, model.py's loaders, train.py, eval.py,
tiny.py) can take its resolvers and its output rules from here without an import circle.

Where models come from. `resolve_model_dir` turns what a user names (a local folder, an alias such as
`tiny` or `qwen2.5-7b`, or a hub id `org/name`) into a local folder with a config.json, downloading
through huggingface_hub (its cache first); offline, the error says how to fetch it elsewhere.

Where outputs go. A command that writes a folder must never destroy what it did not write. The rules
(`check_out`), the same for every CLI:

- `--out` may not be the current folder, one that holds it, the project's folder, or the source the
  command reads (or a folder holding it): replacing any of those would delete them. No flag lifts this.
- A folder that exists and is not empty is replaced only when this same command wrote it (it carries
  the marker file MARKER, which names the command) or when the user passes `--force`.
- A folder is written under a temporary name beside it and renamed into place when complete
  (`new_folder`), so a crash leaves either the old folder or the new one, and the temporary folder is
  removed on any failure. Folders get the permissions of an ordinary mkdir (mkdtemp's are 0700: a
  serving process run as another user could not read them).
"""
import contextlib
import json
import os
import shutil
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ALIASES = {f"qwen2.5-{n}b": f"Qwen/Qwen2.5-{n.upper()}B-Instruct" for n in ("0.5", "1.5", "3", "7", "14", "32")}
ALIASES["tiny"] = os.path.join(HERE, "assets", "tiny")
MARKER = ".qerl-output.json"  # {"written_by": "nvfp4.py"}: which command wrote the folder it lies in


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
    except OSError as e:
        raise SystemExit(f"{prog}: {e.filename or ''}: {e.strerror or e}".lstrip(": ")) from None


# ---------------------------------------------------------------------------------------------
# Where outputs go
# ---------------------------------------------------------------------------------------------

class OutputError(ValueError):
    """An output folder that a command refuses to write (its message says why and what to do)."""


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


def check_out(out, prog, sources=(), force=False):
    """Raise OutputError unless `prog` may write the folder `out` (the rules in the module docstring).
    sources: what the command reads (a model folder, an adapter), which `out` may neither be nor hold.
    Returns "new" (nothing there or an empty folder), "ours" (written by prog before) or "forced"."""
    if not out:
        raise OutputError("the output folder is empty; pass a folder name with --out")
    real = os.path.realpath(out)
    never = [(os.getcwd(), "the current folder"), (HERE, "the project's folder")]
    never += [(s, f"the source {s}") for s in sources if s]
    for path, what in never:
        if _inside(os.path.realpath(path), real):
            what = what if os.path.realpath(path) == real else f"a folder holding {what}"
            raise OutputError(f"--out {out} is {what}, which writing there would replace; "
                              f"name a new folder, e.g. --out runs/{prog.removesuffix('.py')}-out")
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
    if written_by(real) == prog:
        return "ours"
    if force:
        return "forced"
    owner = written_by(real)
    why = f"was written by {owner}, not {prog}" if owner else f"holds files {prog} did not write (e.g. {entries[0]})"
    raise OutputError(f"--out {out} is not empty and {why}; name a new folder, or pass --force to replace "
                      f"its contents")


def normal_permissions(path):
    """Give a folder made by mkdtemp (0700) the permissions an ordinary mkdir would (0777 less the umask)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o777 & ~mask)


def mark(folder, prog, **info):
    """Write the MARKER that lets `prog` recognise `folder` as its own output later."""
    write_json(os.path.join(folder, MARKER), {"written_by": prog, **info})


@contextlib.contextmanager
def new_folder(out, prog, sources=(), force=False):
    """Write a whole output folder atomically: `with new_folder(out, "nvfp4.py", [src]) as tmp:` fill
    tmp; on success it is marked as prog's and renamed to `out` (replacing what check_out allowed), on
    any failure it is removed and `out` is left as it was."""
    check_out(out, prog, sources, force)
    real = os.path.realpath(out)
    parent = os.path.dirname(real)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(real)}.tmp-", dir=parent)
    try:
        normal_permissions(tmp)
        yield tmp
        mark(tmp, prog)
        old = None
        if os.path.exists(real):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(real)}.old-", dir=parent)
            os.replace(real, os.path.join(old, "x"))  # aside, then removed once the new one is in place
        os.replace(tmp, real)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # (gone already after a success)


def claim_folder(out, prog, sources=(), force=False):
    """For a command that writes into its folder as it goes (train.py, eval.py): check `out`, empty it
    when check_out allowed replacing it ("forced"), create it and mark it as prog's. Returns check_out's
    answer."""
    state = check_out(out, prog, sources, force)
    if state == "forced":
        shutil.rmtree(out)
    os.makedirs(out, exist_ok=True)
    mark(out, prog)
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


def write_json(path, obj):
    """Write JSON atomically: a reader (or a crash) sees the old file or the new, never half of one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)
