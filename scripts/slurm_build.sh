#!/usr/bin/env bash
# A packer build as a Slurm job array: array task K of N builds part K of N into
# OUT/part-K (every image in exactly one part); a job after the array merges the parts
# (`packer merge`, which copies no shard and refuses parts that disagree).
#
#   jid=$(sbatch --parsable --array=0-7 --cpus-per-task=16 scripts/slurm_build.sh SRC OUT)
#   sbatch --dependency=afterok:"$jid" --wrap "packer merge OUT/part-* OUT/train"
#
# More arguments go to `packer build` (--coco FILE, --shard-size 2G, ...): the same in every
# task, or the merge refuses the parts. A task that fails or is preempted resumes its part
# when run again (`scontrol requeue`, or resubmit that index). SRC and OUT must be on a
# filesystem every node mounts; the parts stay where they are (the merged manifest points
# into them). Each task checks images on the cores Slurm gave it. docs/distributed.md.
#SBATCH --job-name=packer-build
#SBATCH --output=packer-build-%A_%a.log
set -euo pipefail

if [[ $# -lt 2 ]]; then
  echo "usage: sbatch --array=0-N-1 $0 SRC OUT [packer build options]" >&2
  exit 2
fi
if [[ -z "${SLURM_ARRAY_TASK_ID:-}" || -z "${SLURM_ARRAY_TASK_COUNT:-}" ]]; then
  echo "error: run this as a Slurm job array (sbatch --array=0-N-1 ...): SLURM_ARRAY_TASK_ID and SLURM_ARRAY_TASK_COUNT are not set" >&2
  exit 2
fi
src=$1
out=$2
shift 2
# Parts are numbered from 0: an array given as --array=1-8 counts from its first index, one
# given as --array=0-14:2 in its steps.
id=$SLURM_ARRAY_TASK_ID min=${SLURM_ARRAY_TASK_MIN:-0} step=${SLURM_ARRAY_TASK_STEP:-1}
n=$SLURM_ARRAY_TASK_COUNT
for v in "$id" "$min" "$step" "$n"; do
  [[ "$v" =~ ^[0-9]+$ ]] || { echo "error: Slurm's array variables are not numbers: task $id, first $min, step $step, count $n" >&2; exit 2; }
done
k=$(( (id - min) / (step > 0 ? step : 1) ))
if (( id < min || (id - min) % (step > 0 ? step : 1) != 0 || k >= n )); then
  echo "error: array task $id (first $min, step $step) of $n is not part K of N: give a range with no gaps, --array=0-$((n - 1)) or A-B:STEP" >&2
  exit 2
fi
part=$(printf "%s/part-%05d" "$out" "$k")  # zero-padded: the shell's glob lists them in order
exec packer build "$src" "$part" --part "$k/$n" --quiet "$@"
