"""The one C extension, intake's structural scan (``ext_proc/_jsonscan.c``); everything else is in
pyproject.toml. (setup.py rather than pyproject's ``ext-modules``, which setuptools still calls
experimental.) Optional: without a C compiler the install goes on, and intake and the estimate use
their pure-Python passes (the same answers, slower on large bodies; ``kvgate bench intake`` shows it)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ext_proc._jsonscan", ["ext_proc/_jsonscan.c"], optional=True,
                             extra_compile_args=["-O2"])])
