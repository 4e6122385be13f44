"""Compiling and importing cagrad's C++ extension.

One C++ file (:file:`cagrad_ext.cpp`, next to this module) compiled with the
system C++ compiler (``$CXX`` or ``c++``; no ninja, no pybind11) against the
installed torch's headers and libraries, into the torch extensions directory
(``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions/pyXY_cpu``), one
folder per source, flags, torch and Python version, reused by later
processes (loading it then takes about 40 ms; building 5 to 8 s on a loaded
2-core machine, nearly all of it torch's ``ATen/core/Tensor.h``).

The layouts of ``THPCppFunction`` (python_cpp_function.h), ``THPFunction``
(python_function.h) and the first fields of ``THPVariable``
(python_variable.h) are mirrored in the source instead of included: those
headers pull in pybind11 and compiled autograd (about 8 s more per build).
:func:`layout_ok` checks that the installed headers declare what the mirror
assumes (torch 2.13); with other headers the source is compiled with
``-DCAGRAD_FULL_HEADERS``, which includes them (about 20 s).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from typing import Any

import torch

log = logging.getLogger("cagrad")

SOURCE_PATH = pathlib.Path(__file__).with_name("cagrad_ext.cpp")


def layout_ok() -> str | None:
    """None if the installed headers declare the layouts the source mirrors,
    else what differs."""
    base = os.path.join(os.path.dirname(torch.__file__), "include", "torch", "csrc", "autograd")
    try:
        cpp, py, var = (
            pathlib.Path(base, name).read_text()
            for name in ("python_cpp_function.h", "python_function.h", "python_variable.h")
        )
    except OSError as e:
        return f"cannot read torch's headers: {e}"
    if "struct THPCppFunction {\n  PyObject_HEAD\n  c10::intrusive_ptr<Node> cdata;\n};" not in cpp:
        return "THPCppFunction is not {PyObject_HEAD; intrusive_ptr<Node> cdata}"
    if "struct THPVariable {\n  PyObject_HEAD\n  // Payload\n  at::Tensor cdata;" not in var:
        return "THPVariable does not begin {PyObject_HEAD; at::Tensor cdata}"
    struct = py[py.find("struct THPFunction {") :]
    struct = struct[: struct.find("\n};")]
    if not struct.rstrip().endswith("c10::intrusive_ptr<torch::autograd::Node> cdata;"):
        return "THPFunction does not end with intrusive_ptr<Node> cdata"
    return None


def _compile_flags() -> list[str]:
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths("cpu"), sysconfig.get_paths()["include"]]
    libs = cpp_extension.library_paths("cpu")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        "-shared",
        "-fPIC",
        "-O2",
        "-std=c++20",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-isystem{p}" for p in includes),
        *(f"-L{p}" for p in libs),
        *(f"-Wl,-rpath,{p}" for p in libs),
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
        "-ltorch_python",
    ]


def build_root() -> str:
    """Where extensions are built: ``$TORCH_EXTENSIONS_DIR`` or torch's
    default root, per Python version."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        cpp_extension.get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
    )
    return root


def build(name: str, source: str, defines: tuple[str, ...] = ()) -> Any:
    """Compiles ``source`` (which defines ``PyInit_<MODULE_NAME>``) into an
    extension module and imports it; reuses an earlier build of the same
    source, flags, torch and Python.

    Args:
        defines: more compiler flags (``-DNAME``).

    Raises:
        OSError, subprocess.CalledProcessError, ImportError: no compiler, a
            compile error (its output in the message), or a load failure.
    """
    cxx = os.environ.get("CXX", "c++")
    flags = [*defines, *_compile_flags()]
    digest = hashlib.sha256(
        "\0".join([source, cxx, *flags, torch.__version__, sys.version]).encode()
    ).hexdigest()[:16]
    folder = os.path.join(build_root(), f"{name}_{digest}")
    path = os.path.join(folder, name + ".so")
    if not os.path.exists(path):
        if shutil.which(cxx) is None:
            raise FileNotFoundError(f"no C++ compiler {cxx!r}")
        os.makedirs(folder, exist_ok=True)
        src = os.path.join(folder, f"{name}.cpp")
        tmp_src = f"{src}.{os.getpid()}.tmp"
        with open(tmp_src, "w") as f:
            f.write(source)
        os.replace(tmp_src, src)
        tmp = os.path.join(folder, f"{name}.{os.getpid()}.{threading.get_ident()}.so.tmp")
        start = time.perf_counter()
        proc = subprocess.run(
            [cxx, src, "-o", tmp, f"-DMODULE_NAME={name}", *flags],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cxx, proc.stdout, proc.stderr[-2000:])
        os.replace(tmp, path)  # atomic: concurrent builders write the same file
        log.info("cagrad built %s in %.1f s (%s)", name, time.perf_counter() - start, path)
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def build_cagrad_ext(full_headers: bool | None = None) -> Any:
    """Builds (or reuses) and initializes cagrad's own extension.

    Args:
        full_headers: include torch's Python headers instead of the mirrored
            layouts; None: where :func:`layout_ok` finds a difference.

    Raises:
        as :func:`build`.
    """
    if full_headers is None:
        why = layout_ok()
        full_headers = why is not None
        if full_headers:
            log.info("cagrad builds its extension with torch's Python headers (slower): %s", why)
    module = build("cagrad_hook_counts", SOURCE_PATH.read_text(), ("-DCAGRAD_FULL_HEADERS",) if full_headers else ())
    module.init(torch._C._FunctionBase, torch._C._FunctionBase.__basicsize__ - 8)
    module.set_tensor_types(torch.Tensor, torch.nn.Parameter)
    return module
