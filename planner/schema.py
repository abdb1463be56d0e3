"""JSON Schemas of the configs and the plan, generated from the pydantic models.

The committed files in ``planner/schemas/`` (``schemas/`` at the root) are the published contract; a test fails
when they drift from the models. Regenerate with ``python -m planner.schema``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from planner.config import HardwareConfig, ModelConfig, ServingConfig
from planner.plan import MemoryPlan

#: Package data of ``planner`` (``schemas/`` at the checkout's root links here).
SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
MODELS = {"model": ModelConfig, "hardware": HardwareConfig, "serving": ServingConfig, "plan": MemoryPlan}


def schema_for(kind: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``kind``: model, hardware, serving or plan."""
    schema = MODELS[kind].model_json_schema(mode="validation")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": f"memplan/{kind}.schema.json", **schema}


def schema_text(kind: str) -> str:
    return json.dumps(schema_for(kind), indent=2, sort_keys=True) + "\n"


def load_committed(kind: str) -> dict[str, Any]:
    return json.loads((SCHEMA_DIR / f"{kind}.schema.json").read_text())


def main() -> int:
    SCHEMA_DIR.mkdir(exist_ok=True)
    for kind in MODELS:
        (SCHEMA_DIR / f"{kind}.schema.json").write_text(schema_text(kind))
        print(f"wrote {SCHEMA_DIR / f'{kind}.schema.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
