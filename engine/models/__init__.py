"""Models: the aliases (``agentloop.toml`` and the environment), the chat client of an
OpenAI-compatible endpoint, its streamed replies and reasoning, what a server says of itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_names

#: Public name -> the private module that defines it (imported when first used, PEP 562).
_WHERE = {
    "Chat": "_client", "image_part": "_images", "MAX_IMAGES_A_MESSAGE": "_images", "strip_think":
    "_reasoning", "DEFAULT_MODEL_ID": "_registry", "load_models": "_registry", "ModelConfig":
    "_registry", "ModelRegistry": "_registry", "which_wins": "_registry", "connect": "_server", "probe":
    "_server", "ServerInfo": "_server"
}

if TYPE_CHECKING:
    from ._client import Chat
    from ._images import MAX_IMAGES_A_MESSAGE, image_part
    from ._reasoning import strip_think
    from ._registry import DEFAULT_MODEL_ID, ModelConfig, ModelRegistry, load_models, which_wins
    from ._server import ServerInfo, connect, probe

__getattr__, __dir__ = lazy_names(__name__, _WHERE)

__all__ = [
    "Chat", "DEFAULT_MODEL_ID", "MAX_IMAGES_A_MESSAGE", "ModelConfig", "ModelRegistry", "ServerInfo",
    "connect", "image_part", "load_models", "probe", "strip_think", "which_wins"
]
