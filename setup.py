"""Ships swift_safe_media.pth at the root of site-packages, next to the package."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithStartupHook(build_py):
    def run(self):
        super().run()
        self.copy_file("swift_safe_media.pth", os.path.join(self.build_lib, "swift_safe_media.pth"))


setup(cmdclass={"build_py": BuildPyWithStartupHook})
