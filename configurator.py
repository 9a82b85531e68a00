"""
Config overrides, nanoGPT style. A script defines its defaults as plain globals and then calls

    from configurator import configure
    config = configure(globals())

after which e.g.

    python train.py config/shakespeare_char.py --batch_size=32 --compile=False

first runs each config file (it may only set existing keys), then applies each --key=value.
Values are Python literals (parsed with ast.literal_eval; a bare word is kept as a string where
the default is a string or None) and must have the default's type; a key the script names in
configure(globals(), sources=(...)) takes one folder (a string) or named data sources with weights,
{name: (folder, weight)} (see check_sources). Unlike nanoGPT's exec-based
configurator, a typo or a wrong type is an error that names the key and the fix, and --help
lists every key with its default and the comment from its line in the script.

Every float must be finite. A script then checks the values of its own keys, right after configure:

    check_values(config, [(at_least(1), ('batch_size', 'max_iters')), (interval('[0, 1)'), ('dropout',))])

so a meaningless value (batch_size=0, dropout=1.5) stops the run at start-up with a message naming
the key, not deep inside it. dataclass_args() builds a model's arguments from its config dataclass.

UserError is the exception every module raises for bad user input (missing file, malformed row,
...); configure() installs an excepthook that prints it as one paragraph without a traceback, after undoing
what the refused script had written (on_refusal: a training run's new files in out_dir).
where_set(key) says where the last configure() took a key's value from (two keys that say the same
thing, max_iters and num_train_epochs, are settled by which was set later: run/epochs.py).
"""

import ast
import dataclasses
import difflib
import io
import math
import os
import re
import sys
import tempfile
import tokenize
import types
from typing import NamedTuple

CONFIG_TYPES = (int, float, bool, str, type(None), tuple, list, dict)


class Setting(NamedTuple):
    """Where a key's value came from (where_set): a config file or the command line, and when."""
    order: int  # the position in argv of the file or --key=value that set it last
    source: str  # the config file's path, or 'the command line'


# key -> Setting, of the last configure(); a key left at its default has none
_set_by = {}


def where_set(key):
    """The Setting the last configure() took key's value from; None when it kept the script's default."""
    return _set_by.get(key)

def folder_path(path):
    """Whether path can be a folder: neither it nor any folder above it is an existing file."""
    path = os.path.abspath(path)
    while not os.path.isfile(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return not os.path.isfile(path)


class UserError(Exception):
    """Bad user input. The message names the file/line/key and says how to fix it."""


def require_writable_folder(path, key='out_dir', keep=True, fix=None):
    """Create the folder path if it is missing and check that a file can be written in it: a UserError
    naming key otherwise (a path under a file, /dev/null/x, /proc, a read-only disk), with fix (default: point
    --key elsewhere). Returns the folders it created, outermost first; keep=False removes them again (a
    script that checks its output folder before long work and writes it only at the end)."""
    missing, folder = [], os.path.abspath(path)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        missing.append(folder)
        folder = os.path.dirname(folder)
    created = []
    try:
        for folder in reversed(missing):
            try:
                os.mkdir(folder)
                created.append(folder)
            except FileExistsError:  # made meanwhile by another process, or a file (the next step says so)
                pass
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        remove_folders(created)
        raise UserError(f"{key}={path!r} cannot be created or written ({e.strerror}). "
                        + (fix or f"Point --{key} at a folder you can write, e.g. --{key}=out-run.")) from None
    if not keep:
        remove_folders(created)
    return created


def remove_folders(created):
    """Remove the empty folders require_writable_folder created (outermost first), innermost first."""
    for folder in reversed(created):
        try:
            os.rmdir(folder)
        except OSError:  # something was written there after all: it stays
            break


# what to undo when a UserError ends the script (run/run_folder.claim_out_dir's): a refused run leaves no trace
REFUSAL_CLEANUPS = []


def on_refusal(cleanup):
    """Call cleanup() if a UserError ends this process (the excepthook runs it before exiting with status 2)."""
    REFUSAL_CLEANUPS.append(cleanup)


def run_refusal_cleanups():
    while REFUSAL_CLEANUPS:
        try:
            REFUSAL_CLEANUPS.pop()()
        except OSError:  # a file that cannot be removed stays; the refusal's message matters more
            pass


def same_file(a, b):
    """Whether paths a and b name one file (links and relative spellings resolved; either may not exist)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_output_file(path, key, kind, is_earlier_output, reads=(),
                      others="a checkpoint, a data file or another model's output"):
    """A UserError unless the file path (config key `key`) may be written as a script's output of `kind` ('the
    results JSON', 'a WAV'): a file path in an existing folder, none of the files the script reads (reads),
    and, if a file is there already, one that is_earlier_output(path) recognises as an earlier output of the
    same kind (others, what is never written over, say it in the message)."""
    if not path.strip():  # no name: its folder would be the current one's parent
        raise UserError(f"{key}={path!r} names no file: point --{key} at the file to write {kind} to (nothing was "
                        f"written).")
    if os.path.isdir(path) or not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise UserError(f"{key}={path!r} must be a file path in an existing folder (nothing was written).")
    for read in reads:
        if read and same_file(path, read):
            raise UserError(f"{key}={path!r} is {read}, which this command reads; writing {kind} there would destroy "
                            f"it. Point --{key} at a new file (nothing was written).")
    if os.path.lexists(path) and not (os.path.isfile(path) and is_earlier_output(path)):
        raise UserError(f"{key}={path!r} exists and is not {kind} of an earlier run of this command ({others}, "
                        f"say), so it is left as it is. Point --{key} at a new file, or delete that one yourself if it "
                        f"can go (nothing was written).")
    try:  # written at the end through a temporary beside it: a folder that takes none is said now, not then
        tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(path))).close()
    except OSError as e:
        raise UserError(f"{key}={path!r} is in a folder that cannot be written ({e.strerror or e}); point --{key} at a "
                        f"file in a folder you can write (nothing was written).") from None


# how gloo (and NCCL) report a collective whose peer process has gone
PEER_GONE = ('Connection closed by peer', 'Connection reset by peer', 'Broken pipe', 'NCCL communicator was aborted')


def _excepthook(exc_type, exc, tb, previous=sys.excepthook):
    if issubclass(exc_type, UserError):
        run_refusal_cleanups()
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)  # raising SystemExit from the hook sets the exit status; atexit still runs
    # under torchrun a rank that stopped (bad input, a crash) fails the others' collectives: its
    # message says why, theirs would be a traceback about a closed connection
    if int(os.environ.get('WORLD_SIZE', '1')) > 1 and issubclass(exc_type, RuntimeError) and any(
            s in str(exc) for s in PEER_GONE):
        run_refusal_cleanups()
        print(f"error: rank {os.environ.get('RANK')} stopped: another process of this torchrun ended first (its "
              f"message, above or below, says why).", file=sys.stderr)
        sys.exit(2)
    previous(exc_type, exc, tb)


class ClosedPipeSafe:
    """sys.stdout or sys.stderr, except that once its reader is gone (`train.py | head -3`) a write drops the
    output instead of raising BrokenPipeError (Python ignores SIGPIPE, so writes raise): the run goes on,
    saving and logging to its files, and exits 0."""

    def __init__(self, stream):
        self.stream = stream

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def _call(self, method, *args):
        try:
            return getattr(self.stream, method)(*args)
        except BrokenPipeError:
            # point the descriptor itself at devnull: the interpreter's last flush and C code
            # writing to it are fine too
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
            except (OSError, ValueError):  # no descriptor (a stream in memory)
                self.stream = open(os.devnull, 'w')
            return getattr(self.stream, method)(*args)

    def write(self, text):
        return self._call('write', text)

    def writelines(self, lines):
        return self._call('writelines', lines)

    def flush(self):
        return self._call('flush')


def install_excepthook():
    """Print an uncaught UserError as 'error: <message>' (no traceback) and exit with status 2; and keep a run
    going when its output pipe closes (ClosedPipeSafe). Every script calls this at start-up."""
    sys.excepthook = _excepthook
    for name in ('stdout', 'stderr'):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, ClosedPipeSafe):
            setattr(sys, name, ClosedPipeSafe(stream))


def fail(message):
    print(f"config error: {message}", file=sys.stderr)
    sys.exit(2)


def config_defaults(g):
    """The config keys among a script's globals: lower-case names of plain values (an UPPER_CASE name is a
    constant the script imports or defines, e.g. SCHEDULES or a check_values rule, not a key)."""
    return {k: v for k, v in g.items() if not k.startswith('_') and not k.isupper() and isinstance(v, CONFIG_TYPES)}


def close_keys(key, keys):
    """Up to 3 likely meant keys: similar spelling first, then keys containing it (lr -> min_lr)."""
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    close += [k for k in keys if key in k and k not in close]
    return close[:3]


def unknown_key_message(key, keys):
    close = close_keys(key, keys)
    hint = f"did you mean {' or '.join(repr(k) for k in close)}?" if close else "no key has a similar name."
    return f"unknown config key {key!r}: {hint} Run with --help to list every key."


def a_type(value):
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def check_type(key, value, default):
    """The value converted to the default's type, or None plus a message saying what was expected."""
    if default is None:
        return value, None
    # before int: bool is a subclass of int, and 1 must not pass for True
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, (tuple, list)):
        ok = isinstance(value, (tuple, list))
        value = type(default)(value) if ok else value
    else:
        ok = isinstance(value, type(default))
    if ok:
        return value, None
    return None, (f"{key} must be {a_type(default)} like its default {default!r}, "
                  f"got {value!r} ({a_type(value)})")


# a source's name: it is written into log keys (train_loss/<name>) and TensorBoard tags
SOURCE_NAME = re.compile(r'[A-Za-z0-9_.-]+')


def check_sources(key, value):
    """None if value names data as a sources key may: one folder (a string), or named sources {name: (folder,
    weight)} (a folder alone: weight 1), names of letters, digits, '_', '.', '-', weights finite numbers >= 0,
    one of them positive; else what is wrong."""
    example = f"e.g. {key}={{'math': ('data/math', 1.0), 'chat': ('data/chat', 0.5)}}"
    if isinstance(value, str):
        return None
    if not isinstance(value, dict) or not value:
        return (f"{key} must be a folder (a string) or named sources {{name: (folder, weight)}}, {example}; got "
                f"{value!r}")
    for name, source in value.items():
        folder, weight = (source, 1.0) if isinstance(source, str) else \
            source if isinstance(source, (tuple, list)) and len(source) == 2 else (None, None)
        if not (isinstance(name, str) and SOURCE_NAME.fullmatch(name)):
            return f"{key}: the source name {name!r} must be letters, digits, '_', '.' or '-' ({example})"
        if not isinstance(folder, str) or isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                or not math.isfinite(weight) or weight < 0:
            return (f"{key}[{name!r}] = {source!r} must be (folder, weight) with a finite weight >= 0, or a folder "
                    f"alone (weight 1); {example}")
    if not any(weight for _, _, weight in data_sources(value)):
        return f"{key}={value!r}: every weight is 0; give one source a positive weight"
    return None


def data_sources(value):
    """The sources a sources key names (check_sources) as [(name, folder, weight)]: one folder is [(None, folder,
    1.0)], unnamed."""
    if isinstance(value, str):
        return [(None, value, 1.0)]
    return [(name, *((source, 1.0) if isinstance(source, str) else (source[0], float(source[1]))))
            for name, source in value.items()]


def parse_value(key, text, default, sources=False):
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
        if default is not None and not isinstance(default, str):
            fail(f"--{key}={text}: {text!r} is not a Python literal; {key} is {a_type(default)}, "
                 f"e.g. --{key}={default!r}.")
        if sources and text.lstrip()[:1] in ('{', '[', '('):  # meant as named sources, not a folder's name
            fail(f"--{key}={text}: {text!r} is not a Python literal (numbers and strings only: no calls such as "
                 f"float('nan')); e.g. --{key}=\"{{'math': ('data/math', 1.0), 'chat': ('data/chat', 0.5)}}\".")
    if isinstance(default, str) and not isinstance(value, str) and not (sources and isinstance(value, (dict, list, tuple))):
        value = text  # --out_dir=2024 or --device=0 mean the string
    if sources:
        problem = check_sources(key, value)
        if problem:
            fail(f"--{key}={text}: {problem}.")
        return value
    value, problem = check_type(key, value, default)
    if problem:
        fail(f"--{key}={text}: {problem}. Pass e.g. --{key}={default!r}.")
    return value


def assignment_lines(path):
    """{name: line number} of the top-level assignments in a Python source file."""
    with open(path, encoding='utf-8') as f:
        tree = ast.parse(f.read(), filename=path)
    lines = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, 'target', None)]
        for target in targets:
            if isinstance(target, ast.Name):
                lines.setdefault(target.id, node.lineno)
    return lines


def line_comments(path):
    """{line number: comment text} for every # comment in a Python source file."""
    with open(path, 'rb') as f:
        tokens = tokenize.tokenize(io.BytesIO(f.read()).readline)
        return {t.start[0]: t.string.lstrip('#').strip() for t in tokens if t.type == tokenize.COMMENT}


def print_help(g, defaults):
    script = g.get('__file__')
    name = os.path.basename(script) if script else 'script'
    print(f"usage: python {name} [config/file.py ...] [--key=value ...]\n")
    if g.get('__doc__'):
        print(g['__doc__'].strip() + "\n")
    print("config keys (default value, then the comment from the script):")
    comments = {}
    if script and os.path.exists(script):
        by_line = line_comments(script)
        comments = {k: by_line[n] for k, n in assignment_lines(script).items() if n in by_line}
    width = max((len(f"{k} = {v!r}") for k, v in defaults.items()), default=0)
    for k, v in defaults.items():
        entry = f"{k} = {v!r}"
        print(f"  --{entry:<{width}}  {comments.get(k, '')}".rstrip())


def line_in_traceback(exc, path):
    """The last line of file path that the exception passed through."""
    tb = exc.__traceback__
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def load_config_file(path, defaults, sources=()):
    """Run a config file in a fresh namespace and return its (checked) settings (sources: as configure's)."""
    if not os.path.isfile(path):
        problem = 'is a folder' if os.path.isdir(path) else f'not found (looked relative to {os.getcwd()})'
        fail(f"config file {path!r} {problem}. Pass the path of an existing file (config/ holds the documented "
             f"ones; each names its script).")
    try:
        with open(path, encoding='utf-8') as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"config file {path!r} cannot be read ({e}). A config file is Python source in UTF-8; fix or "
             f"re-save it.")
    namespace = {}
    try:
        exec(compile(source, path, 'exec'), namespace)
    except (Exception, SystemExit) as e:  # any error in the user's file, reported with its line; exit() no run
        line = e.lineno if isinstance(e, SyntaxError) else line_in_traceback(e, path)
        detail = e.msg if isinstance(e, SyntaxError) else str(e)
        if isinstance(e, SystemExit):
            detail = f"it calls exit({'' if e.code is None else repr(e.code)}), and a config file only sets keys"
        fail(f"{path}{f' line {line}' if line else ''}: {type(e).__name__}: {detail}. Fix the config file.")
    lines = assignment_lines(path)
    settings = {}
    for key, value in namespace.items():
        if key.startswith('_') or isinstance(value, types.ModuleType):
            continue
        where = f"{path} line {lines[key]}" if key in lines else path
        if key not in defaults:
            fail(f"{where}: {unknown_key_message(key, defaults)}")
        value, problem = (value, check_sources(key, value)) if key in sources else check_type(key, value, defaults[key])
        if problem:
            fail(f"{where}: {problem}. Fix the value in the config file.")
        settings[key] = value
    return settings


def configure(g, argv=None, sources=()):
    """Apply config files and --key=value overrides from argv to the globals dict g.
    sources: keys that take named data sources as well as one folder (check_sources).
    Returns {key: value} for every config key (the resolved config)."""
    install_excepthook()
    argv = sys.argv[1:] if argv is None else argv
    # types are checked against these, not against a config file's values
    defaults = config_defaults(g)
    _set_by.clear()
    if '-h' in argv or '--help' in argv:
        print_help(g, defaults)  # `--help | head`: ClosedPipeSafe drops the rest
        sys.exit(0)
    for order, arg in enumerate(argv):
        if not arg.startswith('-'):
            settings = load_config_file(arg, defaults, sources)
            for key, value in settings.items():
                print(f"overriding {key} = {value!r} (from {arg})")
                _set_by[key] = Setting(order, arg)
            g.update(settings)
            continue
        if not arg.startswith('--') or '=' not in arg:
            example = next(iter(defaults))  # one of this script's own keys
            fail(f"cannot read argument {arg!r}: overrides are written --key=value "
                 f"(e.g. --{example}={defaults[example]!r}) and config files as paths (config/x.py).")
        key, text = arg[2:].split('=', 1)
        if key not in defaults:
            fail(f"--{key}: {unknown_key_message(key, defaults)}")
        try:  # bytes that are not UTF-8 reach Python as lone surrogates, which no tokenizer or file takes
            text.encode('utf-8')
        except UnicodeEncodeError:
            fail(f"--{key}: its value is not UTF-8 text (bytes {os.fsencode(text)!r}); give it in UTF-8 (a path: "
                 f"rename it to UTF-8).")
        value = parse_value(key, text, defaults[key], key in sources)
        print(f"overriding {key} = {value!r}")
        g[key] = value
        _set_by[key] = Setting(order, 'the command line')
    config = {k: g[k] for k in defaults}
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"{key}={value}: must be a finite number.")
    return config


# Value rules for check_values: (test, what), what completing "{key}={value!r} must be ...".

def at_least(low):
    def test(value):
        return value >= low
    return test, f'at least {low}'


def interval(notation):
    """Within an interval written as in maths: '[0, 1)' holds 0 and not 1, '(0, 1)' neither end, '[0, 1]' both."""
    low, high = (float(end) for end in notation[1:-1].split(','))

    def test(value):
        above_low = low <= value if notation[0] == '[' else low < value
        below_high = value <= high if notation[-1] == ']' else value < high
        return above_low and below_high
    return test, f'in {notation}'


def one_of(choices):
    def test(value):
        return value in choices
    return test, f"one of {', '.join(choices)}"


def is_positive(value):
    return value > 0


def is_folder(value):
    return bool(value) and folder_path(value)


def is_empty_or_folder(value):
    return not value or folder_path(value)


def is_seed(value):
    return -2 ** 63 <= value < 2 ** 64  # what torch.manual_seed takes


POSITIVE = (is_positive, 'positive')
SEED = (is_seed, 'a seed torch takes, an integer in [-2**63, 2**64)')
FOLDER = (is_folder, 'a folder path (not empty, no part of it an existing file)')
EMPTY_OR_FOLDER = (is_empty_or_folder, "'' or a folder path (no part of it an existing file)")


def check_values(config, rules):
    """Exit with a config error naming the first key whose value breaks its rule. rules: [(rule, keys), ...]."""
    for (test, what), keys in rules:
        for key in keys:
            if not test(config[key]):
                fail(f"{key}={config[key]!r} must be {what}.")


def dataclass_args(cls, config, **given):
    """{field: value} for the fields of dataclass cls, in their order: the given value, else the config key's.
    A field that is neither is left out, so it keeps its default (a model setting the script does not expose)."""
    names = [field.name for field in dataclasses.fields(cls)]
    return {name: given[name] if name in given else config[name] for name in names if name in given or name in config}
