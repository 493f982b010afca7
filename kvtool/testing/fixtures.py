"""The real-model fixtures, for tests: kept as a name for kvtool.fixtures (where they live).

`python -m kvtool.testing.fixtures` still builds them (older CI scripts call it)."""

import sys

from kvtool.fixtures import (FIXTURE_VERSION, SOURCES, FixtureUnavailable, cache_root, fixture_dir,  # noqa: F401
                             gemma3_dir, main, smollm2_dir)

if __name__ == "__main__":
    sys.exit(main())
