"""File mechanics, whatever the format: torch archives read (mapped, CRC-checked) and written (torch_zip),
weights-only unpickling, bounded small-file reads, page release, output files written front to back, the
staging directory and its publishing, what --force may replace, and the paths a run must never touch."""
