"""python -m m3serve.server: see m3serve.server.cli."""
from m3serve.server.cli import main

raise SystemExit(main())
