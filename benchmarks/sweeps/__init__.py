"""The accuracy sweeps behind ``benchmarks/accuracy_seeds.py`` and ``benchmarks/accuracy_arm.py``: ``seeds`` (the
runner), ``arm`` (one (seed, arm) unit), ``units`` (their folders), ``files`` (the result files combined and what they
must agree on), ``report`` and ``stop`` (the paired summary, issue 38's stop pairs), ``stats`` (its statistics)."""
