"""The benchmark scripts' helpers (``benchmarks/benchlib``) are not in the wheel: import them
from the repository, as the scripts do."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
