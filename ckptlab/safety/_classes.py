"""What a global a pickle names would do if it were imported and called: ``torch``, ``data`` or
``code``.

This is ckptlab's documented list (README, "Is this file safe?"). The rules, in order:

1. **torch**: the global is one ``torch.load(weights_only=True)`` of the installed torch allows
   (its default allow-list and :func:`torch.serialization.get_safe_globals`: decided by
   :mod:`ckptlab.safety._weights_only` at call time), or one of torch's own rebuild functions
   listed in :data:`TORCH_REBUILDS`.
2. **code**: the global runs code or touches the system when imported, called or built
   (:data:`CODE_MODULES`, any submodule of them included; :data:`CODE_NAMES`; every
   ``builtins`` name but the plain types of :data:`DATA_BUILTINS`), or reaches an attribute
   through a dotted name (``torch.serialization.os.system``: protocol 4 resolves dots with
   ``getattr``) other than a nested class.
3. **data**: a known plain-data class (:data:`DATA_NAMES`, :data:`DATA_MODULES`), or a global
   the file uses the way plain objects are pickled: a class created with ``NEWOBJ`` or
   ``copyreg``'s reconstructors, a class name (``CapWords``) called with its arguments (an enum
   member, a namedtuple), or a name only referred to. Importing a module ckptlab does not know
   still runs that module's code: such a global is never ``torch``.
4. Anything else is **code**: a function ckptlab does not know called with arguments
   (``REDUCE``, ``INST``, ``OBJ``) might do anything.

The mapping of Python 2 names (``__builtin__``, ``copy_reg``) that the standard unpickler applies
is applied first, so ``__builtin__.eval`` is ``builtins.eval``.
"""

from __future__ import annotations

import _compat_pickle

__all__ = [
    "CODE_MODULES",
    "CODE_NAMES",
    "DATA_BUILTINS",
    "DATA_MODULES",
    "DATA_NAMES",
    "TORCH_REBUILDS",
    "classify",
    "python3_name",
]

#: modules (and every module below them) whose globals run code or touch the system
CODE_MODULES = frozenset({
    # the process, the system, files and the network
    "os", "posix", "nt", "posixpath", "ntpath", "sys", "subprocess", "socket", "ssl",
    "signal", "pty", "tty", "termios", "fcntl", "resource", "platform", "shutil", "tempfile",
    "glob", "fileinput", "io", "_io", "mmap", "select", "selectors",
    "multiprocessing", "threading", "_thread", "concurrent", "asyncio", "sched",
    "http", "urllib", "urllib2", "httplib", "ftplib", "smtplib", "telnetlib", "poplib",
    "imaplib", "xmlrpc", "socketserver", "webbrowser", "requests", "aiohttp", "paramiko",
    # running and loading code
    "code", "codeop", "pdb", "bdb", "runpy", "importlib", "imp", "zipimport",
    "pkgutil", "site", "sysconfig", "distutils", "setuptools", "pip", "ctypes", "_ctypes",
    "cffi", "types", "marshal", "pickle", "_pickle", "cPickle", "pickletools", "dill", "cloudpickle", "joblib", "timeit", "trace", "profile", "cProfile", "inspect",
    "commands", "popen2", "operator", "_operator", "atexit", "unittest", "doctest",
    "idlelib", "tkinter", "turtle", "venv", "ensurepip", "zipapp", "compileall", "py_compile",
    "dis", "ast", "_ast", "symtable", "tokenize", "_posixsubprocess", "_winapi", "msvcrt",
    "winreg", "_winreg",
    # libraries' loaders and compilers
    "numpy.f2py", "numpy.testing", "numpy.distutils", "numpy.ctypeslib", "numpy.lib.npyio",
    "numpy.lib.format", "torch.hub", "torch.jit", "torch.fx", "torch.package",
    "torch.utils.cpp_extension", "torch._C", "torch.ops", "torch._ops",
    "torch._dynamo", "torch._inductor", "torch.compiler", "torch.distributed.rpc",
    "torch.multiprocessing", "torch.testing", "torch.export", "torch._export", "torch.onnx",
    "torch.library", "torch._library", "torch.utils.benchmark",
})

#: single globals that run code, in modules that are otherwise data
CODE_NAMES = frozenset({
    "torch.load", "torch.save", "torch.serialization.load", "torch.serialization.save",
    "torch.from_file", "torch.storage._load_from_bytes_unsafe",
    "numpy.load", "numpy.save", "numpy.savez", "numpy.savez_compressed", "numpy.fromfile",
    "numpy.loadtxt", "numpy.genfromtxt", "numpy.memmap", "numpy.savetxt", "numpy.frompyfunc",
    "numpy.vectorize", "numpy.core.memmap.memmap", "numpy._core.memmap.memmap",
    "collections.namedtuple", "re.sub", "re.subn", "codecs.open", "codecs.getreader",
    "codecs.getwriter", "codecs.lookup", "copyreg.add_extension", "copyreg.pickle",
    "functools.reduce", "functools.cmp_to_key", "functools.singledispatch",
    "omegaconf.omegaconf.OmegaConf", "omegaconf.OmegaConf",
})

#: the ``builtins`` that only build plain values; every other builtin is code
DATA_BUILTINS = frozenset({
    "set", "frozenset", "bytearray", "bytes", "complex", "slice", "range", "list", "dict",
    "tuple", "int", "float", "str", "bool", "object", "NotImplemented", "Ellipsis",
    "reversed", "enumerate", "zip", "Exception", "ValueError", "KeyError", "TypeError",
    "RuntimeError",
})

#: known plain-data classes and constructors
DATA_NAMES = frozenset({
    "argparse.Namespace", "copyreg._reconstructor", "copyreg.__newobj__",
    "copyreg.__newobj_ex__", "_codecs.encode", "codecs.encode", "codecs.decode",
    "collections.OrderedDict", "collections.Counter", "collections.defaultdict",
    "collections.deque", "collections.ChainMap", "collections.UserDict",
    "collections.UserList", "collections.UserString", "re._compile", "re.compile",
    "functools.partial", "datetime.datetime", "datetime.date", "datetime.time",
    "datetime.timedelta", "datetime.timezone", "numpy.core.multiarray._reconstruct",
    "enum.Enum", "enum.IntEnum", "enum.Flag", "enum.IntFlag",
    "numpy.dtype", "numpy.ndarray", "numpy.core.multiarray.scalar", "numpy._core.multiarray._reconstruct",
    "numpy._core.multiarray.scalar", "torch.storage._load_from_bytes",
})

#: modules whose classes are plain data (their functions still go by the shape rule)
DATA_MODULES = frozenset({
    "datetime", "decimal", "fractions", "uuid", "pathlib", "ipaddress", "typing", "numbers",
    "omegaconf", "numpy", "torch", "collections", "enum", "dataclasses", "argparse",
})

#: torch's functions that rebuild tensors and storages (some are not in every torch's
#: weights-only allow-list, none runs code)
TORCH_REBUILDS = frozenset({
    "torch._utils._rebuild_tensor", "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_tensor_v3", "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state", "torch._utils._rebuild_qtensor",
    "torch._utils._rebuild_sparse_tensor", "torch._utils._rebuild_sparse_csr_tensor",
    "torch._utils._rebuild_meta_tensor_no_storage", "torch._utils._rebuild_nested_tensor",
    "torch._utils._rebuild_wrapper_subclass", "torch._utils._rebuild_device_tensor_from_numpy",
    "torch._utils._rebuild_device_tensor_from_cpu_tensor", "torch._tensor._rebuild_from_type",
    "torch._tensor._rebuild_from_type_v2", "torch.serialization._get_layout", "torch.Size",
    "torch.device", "torch.Tensor", "torch.nn.parameter.Parameter",
})

#: how a global is used, as :func:`classify` takes it
USES = ("name", "new", "call", "build")


def python3_name(qualname: str) -> str:
    """``module.name`` as the standard unpickler finds it under ``fix_imports``: Python 2
    names (``__builtin__.eval``, ``copy_reg._reconstructor``) mapped to Python 3's."""
    module, _, name = qualname.rpartition(".")
    if "." in name or not module:
        return qualname
    mapped = _compat_pickle.NAME_MAPPING.get((module, name))
    if mapped is not None:
        return ".".join(mapped)
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


def _in_modules(module: str, modules: frozenset[str]) -> bool:
    parts = module.split(".")
    return any(".".join(parts[:i]) in modules for i in range(1, len(parts) + 1))


def _class_like(name: str) -> bool:
    return name.lstrip("_")[:1].isupper()


def classify(module: str, name: str, uses: frozenset[str] | set[str], *,
             torch_allowed: frozenset[str] = frozenset()) -> tuple[str, str]:
    """The class of global ``module.name`` and why, in a few words.

    Parameters
    ----------
    module, name
        As the pickle names them (``name`` may hold dots: an attribute path).
    uses
        How the pickle uses it (:data:`USES`): ``name`` (only referred to), ``new`` (an object
        created from it without calling it: ``NEWOBJ``, ``copyreg`` reconstructors), ``call``
        (called with arguments: ``REDUCE``, ``INST``, ``OBJ``), ``build`` (attributes set on
        the global itself by ``BUILD``).
    torch_allowed
        The globals ``torch.load(weights_only=True)`` allows (``module.name``).

    Returns
    -------
    tuple
        ``(klass, why)`` with ``klass`` one of ``"torch"``, ``"data"``, ``"code"``.
    """
    full = python3_name(f"{module}.{name}")
    if "." not in name:
        module, _, name = full.rpartition(".")
    if "build" in uses:
        return "code", "BUILD sets attributes on the global itself (a module or class)"
    if full in torch_allowed or full in TORCH_REBUILDS:
        return "torch", "allowed by torch.load(weights_only=True)" if full in torch_allowed \
            else "one of torch's rebuild functions"
    if full in CODE_NAMES:
        return "code", "runs code or touches the system"
    if _in_modules(full.rsplit(".", 1)[0], CODE_MODULES) or _in_modules(full, CODE_MODULES):
        return "code", f"in module {full.rsplit('.', 1)[0]}, which runs code or touches the system"
    if full.startswith("builtins."):
        short = full[len("builtins."):]
        if short in DATA_BUILTINS:
            return "data", "a plain built-in type"
        return "code", "a built-in function that is not a plain type"
    if "." in name:  # an attribute path: nested classes are data, anything else reaches code
        if all(_class_like(part) for part in name.split(".")):
            return "data", "a nested class"
        return "code", "reaches an attribute through a dotted name (getattr)"
    if full in DATA_NAMES:
        return "data", "a plain-data class"
    known = _in_modules(module, DATA_MODULES)
    if "call" in uses and not _class_like(name):
        return "code", "a function called with arguments" + (
            "" if known else f" (module {module} is not known to ckptlab)")
    where = "" if known else f"; importing {module} runs that module's code"
    if "call" in uses:
        return "data", f"a class called with its arguments{where}"
    if "new" in uses:
        return "data", f"a class the pickle creates{where}"
    return "data", f"referred to, not called{where}"
