#!/usr/bin/env bash
# Makes .venv-peer/ with the Hugging Face stack the peer benchmark runs on
# (from PyPI; the torch wheel is large). `padfree bench --peer` runs this
# when .venv-peer/ is missing; by hand, then:
#   padfree bench --peer-python .venv-peer/bin/python
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m venv .venv-peer
.venv-peer/bin/pip install --quiet torch==2.15.0 transformers==5.24.0 safetensors accelerate==1.15.0 peft==0.21.2
.venv-peer/bin/python -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
