"""Import stand-ins for packages that SGLang 0.5.23 imports at module level but never calls on its CPU path.

Used only inside the `.venv-sglang` test environment (tests/sglang/cpu_env/build.sh puts this folder on its
sys.path with a .pth file); never in the project's own environment.

`install(package)` makes `package` and every submodule below it importable. Any attribute of them, at any
depth, is a `StandIn`: an object that can be imported, passed around, read further (`a.b.c`) and used as a
default argument or a dict value, and that raises NotImplementedError only when it is *called*. So the
62 module-level `from sgl_kernel import ...` sites of SGLang import cleanly, and a call that would have reached
a CUDA kernel fails loudly with the name of what was called instead of computing something wrong.

Covered: `import p`, `import p.x.y`, `from p import f`, `from p.x import f`, attribute chains, `repr`, truthiness
(a stand-in is truthy, like a function). Not covered: subclassing a stand-in, arithmetic or comparison with it,
`torch.ops.<package>.*` registrations (they stay absent, which is what keeps SGLang's CPU-kernel path off),
and `importlib.metadata.version(package)` (no distribution metadata: raises PackageNotFoundError; the
package's `__version__` is "0.0.0+standin", older than any release, for checks that fall back to it).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

STANDIN_VERSION = "0.0.0+standin"


class StandIn:
    """A placeholder for a kernel or class of a missing package; raises NotImplementedError when called."""

    __slots__ = ("_standin_name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_standin_name", name)

    def __call__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(
            f"{self._standin_name} was called, but it is an import stand-in from tests/sglang/cpu_env/shims "
            "(the real package is CUDA-only). The SGLang CPU test environment must never reach it; if it did, "
            "a server flag picked a GPU code path: check --device cpu / --attention-backend torch_native."
        )

    def __getattr__(self, attr: str) -> StandIn:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return StandIn(f"{self._standin_name}.{attr}")

    def __repr__(self) -> str:
        return f"<import stand-in {self._standin_name}>"


def _module_getattr(module_name: str):
    def __getattr__(attr: str) -> StandIn:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r}")
        return StandIn(f"{module_name}.{attr}")

    return __getattr__


def _fill(module: types.ModuleType) -> None:
    module.__getattr__ = _module_getattr(module.__name__)  # PEP 562: every missing name is a stand-in
    module.__path__ = []  # a package, so that deeper submodules can be imported too
    module.STANDIN = True


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates every submodule of the stand-in packages on demand."""

    def __init__(self) -> None:
        self.packages: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in self.packages and "." in fullname:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        _fill(module)


_FINDER = _Finder()


def install(package: types.ModuleType) -> None:
    """Turn the (already imported) top-level `package` into a stand-in with stand-in submodules."""
    _fill(package)
    # A valid version older than any release: version checks (transformers reads torchvision.__version__
    # when it finds no distribution metadata) parse it and take their "too old" branch.
    package.__version__ = STANDIN_VERSION
    _FINDER.packages.add(package.__name__)
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
