"""Models: the aliases (``agentloop.toml`` and the environment), the chat client of an
OpenAI-compatible endpoint, its streamed replies and reasoning, what a server says of itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_names

#: Public name -> the private module that defines it (imported when first used, PEP 562).
_WHERE = {
    "Chat": "_client", "ClientPool": "_pool", "address_refusal": "_endpoint", "checked_client": "_endpoint",
    "connection_refusal": "_endpoint", "owner_name": "_endpoint", "raise_if_foreign": "_endpoint",
    "image_part": "_images", "MAX_IMAGES_A_MESSAGE": "_images", "strip_think": "_reasoning",
    "DEFAULT_MODEL_ID": "_registry", "load_models": "_registry", "ModelConfig": "_registry",
    "ModelRegistry": "_registry", "unsent_key_note": "_registry", "which_wins": "_registry", "connect":
    "_server", "probe": "_server", "ServerInfo": "_server"
}

if TYPE_CHECKING:
    from ._client import Chat
    from ._endpoint import address_refusal, checked_client, connection_refusal, owner_name, raise_if_foreign
    from ._images import MAX_IMAGES_A_MESSAGE, image_part
    from ._pool import ClientPool
    from ._reasoning import strip_think
    from ._registry import (
        DEFAULT_MODEL_ID,
        ModelConfig,
        ModelRegistry,
        load_models,
        unsent_key_note,
        which_wins,
    )
    from ._server import ServerInfo, connect, probe

__getattr__, __dir__ = lazy_names(__name__, _WHERE)

__all__ = [
    "Chat", "ClientPool", "DEFAULT_MODEL_ID", "MAX_IMAGES_A_MESSAGE", "ModelConfig", "ModelRegistry", "ServerInfo",
    "address_refusal", "checked_client", "connect", "connection_refusal", "image_part", "load_models",
    "owner_name", "probe", "raise_if_foreign", "strip_think", "unsent_key_note", "which_wins"
]
