"""matplotlib's backend in a worker (``module://worker.mpl_backend``): figures become displays.

Agg draws; ``plt.show()`` displays the figures the current block made and closes them, as
Jupyter's inline backend does, and ``fig.show()`` displays that figure.  Each figure remembers
the block whose code made it, so blocks running at the same time show their own figures only
(pyplot's current figure is still one for the whole process: blocks that draw at the same time
through ``plt.*`` can draw on each other's).  Imported by matplotlib when the code first needs a
backend, never by the worker itself (``display``).
"""

from __future__ import annotations

from matplotlib.backend_bases import FigureManagerBase
from matplotlib.backends.backend_agg import FigureCanvasAgg

from .capture import current_block
from .display import active

__all__ = ["FigureCanvas", "FigureManager", "show"]


class FigureManager(FigureManagerBase):
    def __init__(self, canvas: FigureCanvasAgg, num: int | str) -> None:
        super().__init__(canvas, num)
        canvas.figure._agentloop_block = current_block.get()  # type: ignore[attr-defined]

    def show(self) -> None:
        """``fig.show()``: this figure, now."""
        displays = active()
        if displays is not None:
            displays.show(self.canvas.figure)

    @classmethod
    def pyplot_show(cls, *, block: bool | None = None) -> None:
        """``plt.show()``: the current block's open figures, then closed."""
        displays = active()
        if displays is not None:
            displays.show_figures(current_block.get())


class FigureCanvas(FigureCanvasAgg):
    manager_class = FigureManager


def show(*, block: bool | None = None) -> None:
    """``plt.show()`` for a matplotlib that asks the module rather than the manager."""
    FigureManager.pyplot_show(block=block)
