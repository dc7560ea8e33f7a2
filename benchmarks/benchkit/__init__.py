"""What every benchmark shares: ``out`` (each run's own output folder, or the committed results when ``--out`` names
them), ``args`` (argument checks), ``plots`` (matplotlib off-screen, figures written atomically)."""
