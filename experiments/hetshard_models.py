"""The zoo (``models/``) under its installed name, ``hetshard_models``, for the scripts of
a checkout: importing this file loads the checkout's own ``models/`` as the package
``hetshard_models`` and puts it in its place, so the experiments run whether or not the
checkout was installed (``pip install -e .`` maps the name to the same directory), and on
a machine where nothing was installed (a GPU box handed the working tree). The tests load
it too (``tests/conftest.py``): a checkout's tests and experiments use its own zoo."""

import importlib.util
import os
import sys

_ZOO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")
_spec = importlib.util.spec_from_file_location(
    "hetshard_models", os.path.join(_ZOO, "__init__.py"), submodule_search_locations=[_ZOO])
_package = importlib.util.module_from_spec(_spec)
sys.modules["hetshard_models"] = _package  # (what ``import hetshard_models`` returns)
_spec.loader.exec_module(_package)
