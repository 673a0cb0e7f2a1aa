"""placeholder until the tiny model lands"""
from pathlib import Path
TINY_MODEL_DIR = Path(__file__).parent / "tiny"
