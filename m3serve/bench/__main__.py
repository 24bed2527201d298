"""python -m m3serve.bench: see m3serve.bench.cli."""
from m3serve.bench.cli import main

raise SystemExit(main())
