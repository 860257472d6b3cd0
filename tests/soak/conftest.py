"""The soak suites use the integration suites' fixtures (the binaries, the
default model, the process logs printed on failure): that conftest, loaded
under its own name."""

import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location(
    "integration_conftest", pathlib.Path(__file__).resolve().parents[1] / "integration" / "conftest.py")
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)

tandem_bin = _conftest.tandem_bin
default_model = _conftest.default_model
