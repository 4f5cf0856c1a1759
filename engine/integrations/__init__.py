"""agentloop's workers where agents already live, each behind an optional extra.

- ``engine.integrations.mcp``: the MCP server behind ``agentloop mcp`` (the ``mcp`` extra).
- ``engine.integrations.smolagents``: an executor for smolagents' ``CodeAgent``
  (the ``smolagents`` extra).
- ``engine.integrations.run_code_server``: SandboxFusion's ``/run_code`` behind ``agentloop serve``
  (the ``serve`` extra: Starlette and uvicorn); ``run_code_api`` its requests and responses.
- ``engine.integrations.http_gate``: the owner's token in front of every server on TCP.

Nothing here is imported by the engine itself: without the extra, only the module that needs it
fails to import, with a message that says how to install the extra (``engine.extras``).
"""

__all__: list[str] = []
