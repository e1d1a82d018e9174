"""Triton's model repository extension, load and unload, for a server of one model loaded at start
(Triton's model control mode NONE, where every load and unload is an error): here a load of the
served model is answered as done, so that a client that loads its model before using it (tritonclient's
load_model, KServe's RepositoryModelLoad) works unchanged, and everything else is refused saying why.

    load of the served model       done, once it has loaded; nothing is reloaded
    unload of the served model     failed_precondition: it can only be stopped with the server
    load or unload of another      not_found, naming the model: this server loads no other
    a load's parameters            refused (config and file: overrides would need a reload)
    unload_dependents              taken (a boolean; the model has no dependents)
    while the model loads, drains  unavailable, as every model call then

Over gRPC (RepositoryModelLoad / RepositoryModelUnload) and REST (POST
/v2/repository/models/{name}/load and /unload, an optional `{"parameters": {...}}` body)."""

from __future__ import annotations

from collections.abc import Mapping

from pagedserve_adapters.llm_model import AdapterError, LLMModel

Parameter = bool | int | str | bytes


def load(model: LLMModel, name: str, parameters: Mapping[str, Parameter]) -> None:
    """Raise AdapterError unless `name` is the served model, loaded and serving."""
    _check_model(model, name)
    if parameters:
        key = next(iter(parameters))
        raise AdapterError(
            "invalid",
            f"parameters.{key[:64]}: this server loads its one model at start and cannot reload it "
            "with another configuration or files",
        )


def unload(model: LLMModel, name: str, parameters: Mapping[str, Parameter]) -> None:
    """Always raises: the served model is never unloaded while the server runs."""
    _check_model(model, name)
    for key, value in parameters.items():
        if key != "unload_dependents":
            raise AdapterError(
                "invalid", f"parameters.{key[:64]}: unknown; an unload takes unload_dependents alone"
            )
        if not isinstance(value, bool):
            raise AdapterError("invalid", f"parameters.unload_dependents: must be a boolean, got {value!r}")
    raise AdapterError(
        "failed_precondition",
        f"model {name!r} is the one model this server serves, loaded at start: it is unloaded only by "
        "stopping the server",
    )


def _check_model(model: LLMModel, name: str) -> None:
    """A name given, and the served model's, once it has loaded and while it serves (LLMModel.resolve)."""
    if not name:
        raise AdapterError("invalid", "model_name: must not be empty")
    model.resolve(name, "")
