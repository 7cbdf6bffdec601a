"""Only here to put the autoload ``.pth`` at the wheel's root (setup.cfg cannot)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "ray_runai_shim_autoload.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join("packaging", PTH), os.path.join(self.build_lib, PTH))


setup(cmdclass={"build_py": BuildPyWithPth})
