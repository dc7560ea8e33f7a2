"""The component benchmarks behind ``benchmarks/bench_*.py``, one module each: ``loss`` (the fused loss's time and
working memory, ``bench_loss.py``; ``memory``: its memory probes), ``selection`` (the advantage and selection ops,
``bench_select.py``), ``generation`` (the vllm engine against the hf engine, ``bench_generate.py``; ``usage``: what
each call is charged, every process's CPU seconds, and the threads it ran with) and ``trainer`` (stock TRL against
``CPPOTrainer``, ``bench_trl.py``)."""
