"""The GPU validation kit behind ``benchmarks/gpu_check.py``, one job per module.

- :mod:`gpukit.plan`: what the kit runs (the parts, their budgets, the GPU plan and the dry run's tiny one);
- :mod:`gpukit.runner`: the process supervisor (each part in its own process group, under its budget and the
  deadline) and a part's JSON report;
- :mod:`gpukit.parts`: the registry of the parts, run by a child process: :mod:`gpukit.part_tests` (the suite's
  ``cuda``-marked tests), :mod:`gpukit.part_loss`, :mod:`gpukit.part_select`, :mod:`gpukit.part_e2e`;
- :mod:`gpukit.wheels`: the offline wheel installer and the import check;
- :mod:`gpukit.report`: ``summary.md`` / ``summary.json`` and the exit status they report.

Every file goes through :mod:`cppo.fileio` (atomic writes), the environment record is
:func:`cppo.fileio.run_metadata`.
"""
