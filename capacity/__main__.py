import sys

from workloads.venv_hint import dependencies_of

with dependencies_of("capacity"):
    from capacity.cli import main

    sys.exit(main())
