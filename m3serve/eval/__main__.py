"""python -m m3serve.eval: see m3serve.eval.cli."""
from m3serve.eval.cli import main

raise SystemExit(main())
