"""The HTML report of a qualification run: one self-contained file that opens offline.

``render(source, out_file=None, *, verification=None)`` reads a run directory or a sealed bundle directory and writes
the report, by default to ``<source>.html`` beside the directory (never inside it: an extra file in a sealed bundle
fails its verification). It shows the result, counts, commit and verification status at the top (``#summary``), the
cells per campaign, healthy-path overhead and latency charts, a fault → detection → decision → recovery timeline per
cell, the qualification boundaries and the environment.
"""

from qualification.report.render import default_output, render, render_html

__all__ = ["default_output", "render", "render_html"]
