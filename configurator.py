"""
Config overrides, nanoGPT style. A script defines its defaults as plain globals and then calls

    from configurator import configure
    config = configure(globals())

after which e.g.

    python train.py config/shakespeare_char.py --batch_size=32 --compile=False

first runs each config file (it may only set existing keys), then applies each --key=value.
Values are Python literals (parsed with ast.literal_eval; a bare word is kept as a string where
the default is a string or None) and must have the default's type. Unlike nanoGPT's exec-based
configurator, a typo or a wrong type is an error that names the key and the fix, and --help
lists every key with its default and the comment from its line in the script.

UserError is the exception every module raises for bad user input (missing file, malformed row,
...); configure() installs an excepthook that prints it as one paragraph without a traceback.
"""

import ast
import difflib
import io
import math
import os
import sys
import tempfile
import tokenize
import types

from scheduler import SCHEDULES

CONFIG_TYPES = (int, float, bool, str, type(None), tuple, list, dict)

# Values that mean nothing for keys the scripts share (a name means the same in every script): configure()
# rejects them at start-up, before they fail deep inside a run. Every float must also be finite.
VALUE_RULES = [
    (('batch_size', 'gradient_accumulation_steps', 'max_iters', 'eval_interval', 'log_interval', 'eval_iters',
      'eval_pairs', 'max_bad_steps', 'block_size', 'max_length', 'max_prompt_length', 'n_layer', 'n_head', 'n_embd',
      'lora_r', 'bucket_batches', 'restart_iters', 'restart_mult', 'num_samples', 'max_new_tokens', 'n_timesteps',
      'enc_channels', 'enc_layers', 'enc_heads', 'enc_ff_channels', 'enc_kernel', 'dp_channels', 'dec_channels',
      'dec_blocks', 'dec_heads', 'frame_budget'),
     lambda v: v >= 1, 'at least 1'),
    (('early_stopping_patience', 'exact_match_examples', 'warmup_iters', 'lr_decay_iters', 'curriculum_iters',
      'sample_tokens', 'num_threads', 'learning_rate', 'min_lr', 'muon_lr', 'weight_decay', 'grad_clip', 'rpo_alpha',
      'logit_softcap', 'max_minutes', 'eval_utterances', 'audio_samples', 'top_k', 'temperature', 'tts_temperature',
      'guidance', 'prior_weight', 'duration_weight', 'flow_weight'),
     lambda v: v >= 0, 'at least 0'),
    (('dropout', 'lora_dropout', 'beta1', 'beta2', 'muon_momentum', 'cfg_drop', 'sigma_min'),
     lambda v: 0 <= v < 1, 'in [0, 1)'),
    (('val_fraction',), lambda v: 0 < v < 1, 'in (0, 1)'),
    (('top_p', 'decay_frac'), lambda v: 0 <= v <= 1, 'in [0, 1]'),
    (('beta', 'lora_alpha', 'loraplus_lr_ratio', 'length_scale'), lambda v: v > 0, 'positive'),
    (('lr_schedule',), lambda v: v in SCHEDULES, f"one of {', '.join(SCHEDULES)}"),
    (('out_dir',), lambda v: v and folder_path(v), 'a folder path (not empty, no part of it an existing file)'),
    (('cache_dir',), lambda v: not v or folder_path(v), "'' or a folder path (no part of it an existing file)"),
]


def folder_path(path):
    """Whether path can be a folder: neither it nor any folder above it is an existing file."""
    path = os.path.abspath(path)
    while not os.path.isfile(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return not os.path.isfile(path)


class UserError(Exception):
    """Bad user input. The message names the file/line/key and says how to fix it."""


def require_writable_folder(path, key='out_dir'):
    """Create the folder path if it is missing and check that a file can be written in it: a UserError
    naming key otherwise (a path under a file, /dev/null/x, /proc, a read-only disk)."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise UserError(f"{key}={path!r} cannot be created or written ({e.strerror}). Point --{key} at a folder you "
                        f"can write, e.g. --{key}=out-run.") from None


def _excepthook(exc_type, exc, tb, previous=sys.excepthook):
    if issubclass(exc_type, UserError):
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)  # raising SystemExit from the hook sets the exit status; atexit still runs
    previous(exc_type, exc, tb)


def install_excepthook():
    """Print an uncaught UserError as 'error: <message>' (no traceback) and exit with status 2."""
    sys.excepthook = _excepthook


def fail(message):
    print(f"config error: {message}", file=sys.stderr)
    sys.exit(2)


def config_defaults(g):
    return {k: v for k, v in g.items() if not k.startswith('_') and isinstance(v, CONFIG_TYPES)}


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
    if isinstance(default, bool):  # before int: bool is a subclass of int, and 1 must not pass for True
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


def parse_value(key, text, default):
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
        if default is not None and not isinstance(default, str):
            fail(f"--{key}={text}: {text!r} is not a Python literal; {key} is {a_type(default)}, "
                 f"e.g. --{key}={default!r}.")
    if isinstance(default, str) and not isinstance(value, str):
        value = text  # --out_dir=2024 or --device=0 mean the string
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


def load_config_file(path, defaults):
    """Run a config file in a fresh namespace and return its (checked) settings."""
    if not os.path.isfile(path):
        fail(f"config file {path!r} not found (looked relative to {os.getcwd()}). "
             f"Pass the path of an existing file, e.g. config/shakespeare_char.py.")
    with open(path, encoding='utf-8') as f:
        source = f.read()
    namespace = {}
    try:
        exec(compile(source, path, 'exec'), namespace)
    except Exception as e:  # any error in the user's file, reported with its line
        line = e.lineno if isinstance(e, SyntaxError) else line_in_traceback(e, path)
        detail = e.msg if isinstance(e, SyntaxError) else str(e)
        fail(f"{path}{f' line {line}' if line else ''}: {type(e).__name__}: {detail}. Fix the config file.")
    lines = assignment_lines(path)
    settings = {}
    for key, value in namespace.items():
        if key.startswith('_') or isinstance(value, types.ModuleType):
            continue
        where = f"{path} line {lines[key]}" if key in lines else path
        if key not in defaults:
            fail(f"{where}: {unknown_key_message(key, defaults)}")
        value, problem = check_type(key, value, defaults[key])
        if problem:
            fail(f"{where}: {problem}. Fix the value in the config file.")
        settings[key] = value
    return settings


def configure(g, argv=None):
    """Apply config files and --key=value overrides from argv to the globals dict g.
    Returns {key: value} for every config key (the resolved config)."""
    install_excepthook()
    argv = sys.argv[1:] if argv is None else argv
    defaults = config_defaults(g)  # types are checked against these, not against a config file's values
    if '-h' in argv or '--help' in argv:
        try:
            print_help(g, defaults)
            sys.stdout.flush()  # a closed pipe shows up here, not at exit
        except BrokenPipeError:
            # `--help | head`: the reader has what it wanted. Point stdout at devnull so the interpreter's
            # final flush does not fail again (the recipe in Python's signal module documentation).
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    for arg in argv:
        if not arg.startswith('-'):
            settings = load_config_file(arg, defaults)
            for key, value in settings.items():
                print(f"overriding {key} = {value!r} (from {arg})")
            g.update(settings)
            continue
        if not arg.startswith('--') or '=' not in arg:
            fail(f"cannot read argument {arg!r}: overrides are written --key=value "
                 f"(e.g. --batch_size=32) and config files as paths (config/x.py).")
        key, text = arg[2:].split('=', 1)
        if key not in defaults:
            fail(f"--{key}: {unknown_key_message(key, defaults)}")
        value = parse_value(key, text, defaults[key])
        print(f"overriding {key} = {value!r}")
        g[key] = value
    config = {k: g[k] for k in defaults}
    check_values(config)
    return config


def check_values(config):
    """Exit with a config error naming the first key whose value breaks VALUE_RULES or is not a finite float."""
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"{key}={value}: must be a finite number.")
        for keys, ok, what in VALUE_RULES:
            if key in keys and not ok(value):
                fail(f"{key}={value!r} must be {what}.")
