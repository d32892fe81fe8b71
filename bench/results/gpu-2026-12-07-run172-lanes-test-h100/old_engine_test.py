"""Run tests/test_gpu.py's lanes test against an older engine/: python3 old_engine_test.py ENGINE_DIR WORK_DIR.
WORK_DIR gets that engine/, this tree's tests/ helpers and pyproject.toml, and the one test with the imports it needs."""
import ast
import pathlib
import shutil
import subprocess
import sys

engine, work = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
shutil.rmtree(work, ignore_errors=True)
(work / "tests").mkdir(parents=True)
shutil.copytree(engine / "engine", work / "engine")
shutil.copy("pyproject.toml", work)
for name in ("__init__.py", "conftest.py", "models.py"):
    shutil.copy(f"tests/{name}", work / "tests" / name)
source = pathlib.Path("tests/test_gpu.py").read_text()
wanted = [ast.get_source_segment(source, node) for node in ast.parse(source).body
          if isinstance(node, ast.FunctionDef) and node.name in ("cosine", "test_lanes_replaying_full_batches_at_once_give_one_lanes_vectors")]
header = ("import numpy as np\nimport pytest\nimport torch\n\nfrom engine import Engine, EngineConfig\n"
          "from tests.models import BERT_BASE, save_random_model\n\npytestmark = pytest.mark.gpu\n\n\n")
(work / "tests" / "test_lanes_old.py").write_text(header + "\n\n\n".join(wanted) + "\n")
sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-ra", "--tb=short", "-p", "no:logging", "tests/test_lanes_old.py"], cwd=work))
