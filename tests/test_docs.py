import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_faithfulness_parameter_table_is_up_to_date():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "param_table.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
