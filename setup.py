"""Install-time build of the native CPU kernels (src/hydraspec/cpu/csrc) with the system C compiler, where there
is one; without it the package installs all the same (hydraspec.cpu.build)."""
import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        spec = importlib.util.spec_from_file_location("native_build", HERE / "src" / "hydraspec" / "cpu" / "build.py")
        nb = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(nb)
        editable = getattr(self, "editable_mode", False)
        out = nb.PREBUILT if editable else Path(self.build_lib) / "hydraspec" / "prebuilt"
        nb.build_all(out, say=lambda m: self.announce(m, level=3))


setup(cmdclass={"build_py": BuildPyWithKernels})
