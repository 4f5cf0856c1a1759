"""The agent: the seed's code-block conversation loop (tags, sub-agents, ``self``), the native
tool-call protocol, ``ask``, one task run to its end, and where an agent's events go."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_names

#: Public name -> the private module that defines it (imported when first used, PEP 562).
_WHERE = {
    "Answer": "_ask", "AnswerStream": "_ask", "ASK_SYSTEM": "_ask", "Assistant": "_ask", "ClientEvents":
    "_ask", "EXIT_FAILED": "_ask", "PROMPT": "_ask", "OUTPUT_BUDGET": "_code_task", "AgentDisplay":
    "_display", "DispatchDisplay": "_display", "FanoutDisplay": "_display", "JsonlRecorder": "_display",
    "read_recording": "_display", "replay": "_display", "Agent": "_loop", "subagent_limit":
    "_subagents", "cut_hallucinated": "_tags", "find_tags": "_tags", "HALLUCINATION_STOPS": "_tags",
    "SYSTEM": "_tags", "make_agent": "_task", "run_task": "_task", "RunResult": "_task"
}

if TYPE_CHECKING:
    from ._ask import ASK_SYSTEM, EXIT_FAILED, PROMPT, Answer, AnswerStream, Assistant, ClientEvents
    from ._code_task import OUTPUT_BUDGET
    from ._display import AgentDisplay, DispatchDisplay, FanoutDisplay, JsonlRecorder, read_recording, replay
    from ._loop import Agent
    from ._subagents import subagent_limit
    from ._tags import HALLUCINATION_STOPS, SYSTEM, cut_hallucinated, find_tags
    from ._task import RunResult, make_agent, run_task

__getattr__, __dir__ = lazy_names(__name__, _WHERE)

__all__ = [
    "ASK_SYSTEM", "Agent", "AgentDisplay", "Answer", "AnswerStream", "Assistant", "ClientEvents",
    "DispatchDisplay", "EXIT_FAILED", "FanoutDisplay", "HALLUCINATION_STOPS", "JsonlRecorder",
    "OUTPUT_BUDGET", "PROMPT", "RunResult", "SYSTEM", "cut_hallucinated", "find_tags", "make_agent",
    "read_recording", "replay", "run_task", "subagent_limit"
]
