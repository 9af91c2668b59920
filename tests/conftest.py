"""Session-wide test settings."""

import os

# Tests never read or write the user's decoder cache (~/.cache/graphopt); the cache's own
# tests point GRAPHOPT_CACHE_DIR at a temporary folder.
os.environ["GRAPHOPT_CACHE_DIR"] = "off"
