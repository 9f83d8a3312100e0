#!/usr/bin/env bash
# Mount a RAM-backed tmpfs sized for a packed dataset, so `packer stage` can copy it there.
# Run with --help for the details (and why swap matters).
set -euo pipefail

PROG=$(basename -- "$0")
MIB=$((1024 * 1024))

usage() {
    cat <<EOF
Usage: $PROG [--size SIZE | --for DST] [--noswap] [--dry-run] [--umount] [--fstab] MOUNTPOINT
EOF
}

help() {
    usage
    cat <<'EOF'

Mount a tmpfs (a filesystem held in RAM) at MOUNTPOINT, sized for a packed dataset, so that
`packer stage DST MOUNTPOINT/NAME` can copy the dataset there and training reads it from
memory: a cold, slow or shared disk then never stalls the GPUs.

Options:
  --size SIZE   Size of the tmpfs: bytes, or a number with K, M, G or T (powers of 1024),
                e.g. 512M, 40G.
  --for DST     Size it for the packed dataset DST: the bytes of its shards, side tables
                (labels, offsets, columns, paths) and manifest (read from DST/manifest.json)
                plus a margin of 5% + 32 MiB.
  --noswap      Mount with the tmpfs "noswap" option (Linux 6.4 or newer): its pages are
                never swapped out (see "Swap" below).
  --dry-run     Print the commands that would run, and run nothing.
  --fstab       Print the /etc/fstab line that mounts this tmpfs at boot, and run nothing.
  --umount      Unmount the tmpfs at MOUNTPOINT, freeing its RAM (its files are lost).
  -h, --help    Show this help.

Behaviour:
  * The size must fit in free RAM (MemAvailable in /proc/meminfo) with a safety margin of
    10% of total RAM (at least 1 GiB) left for training itself; a bigger size is refused.
    A tmpfs only takes RAM for what is stored in it, but a dataset staged there takes all
    of it, and a machine out of memory swaps or kills processes.
  * Idempotent: if a tmpfs with at least SIZE is already mounted at MOUNTPOINT, nothing is
    done. A smaller one is grown in place (mount -o remount,size=...), keeping its files.
  * Mounting needs root (run it with sudo). When run through sudo, the mount is owned by
    the user who ran sudo (uid/gid from SUDO_UID/SUDO_GID), so staging needs no root.
    No root at all? Stage into /dev/shm, a tmpfs every Linux machine already has
    (usually half of RAM): packer stage DST /dev/shm/NAME

Swap:
  tmpfs pages are ordinary memory and CAN BE SWAPPED OUT when the machine runs short of
  memory. A swapped-out dataset is read back from the swap device at random, so a tmpfs
  can be no faster than an SSD (or slower than the disk you staged from). To check that
  it is not happening:
    swapon --show            # no output: no swap, nothing can be swapped out
    free -h                  # the "Swap: used" column should stay at 0
    vmstat 1                 # the si/so columns (swap in/out) should stay at 0 while training
    grep -E '^(Shmem|SwapCached|SwapFree|SwapTotal):' /proc/meminfo
  To prevent it: size the tmpfs well below free RAM (this script refuses sizes that do not
  fit), mount with --noswap (Linux 6.4+), or lower vm.swappiness (sysctl vm.swappiness=1).

Examples:
  sudo scripts/mount_tmpfs.sh --for /data/packed/train /mnt/ram
  packer stage /data/packed/train /mnt/ram/train
  # ... train with PackedDataset("/mnt/ram/train") ...
  packer unstage /mnt/ram/train && sudo scripts/mount_tmpfs.sh --umount /mnt/ram

  scripts/mount_tmpfs.sh --size 64G --dry-run /mnt/ram   # show what would run
  scripts/mount_tmpfs.sh --for /data/packed/train --fstab /mnt/ram | sudo tee -a /etc/fstab
EOF
}

die() {  # die EXIT_CODE MESSAGE...
    local code=$1
    shift
    printf '%s: error: %s\n' "$PROG" "$*" >&2
    exit "$code"
}

usage_error() {
    usage >&2
    printf '%s: error: %s\n' "$PROG" "$*" >&2
    printf "Try '%s --help' for more information.\n" "$PROG" >&2
    exit 2
}

human() {  # bytes -> "1.5 GiB"
    awk -v b="$1" 'BEGIN {
        split("B KiB MiB GiB TiB PiB", u, " "); i = 1
        while (b >= 1024 && i < 6) { b /= 1024; i++ }
        if (i == 1) printf "%d %s", b, u[i]; else printf "%.1f %s", b, u[i]
    }'
}

parse_size() {  # "64M" -> bytes; fails on anything else
    local text=$1 num unit mult
    if [[ ! $text =~ ^([0-9]+)([KkMmGgTt]?)([iI]?[bB]?)$ ]]; then
        return 1
    fi
    num=${BASH_REMATCH[1]}
    unit=${BASH_REMATCH[2]^^}
    case $unit in
        "") mult=1 ;;
        K) mult=1024 ;;
        M) mult=$MIB ;;
        G) mult=$((1024 * MIB)) ;;
        T) mult=$((1024 * 1024 * MIB)) ;;
    esac
    if ((${#num} > 15 || num > (1 << 60) / mult)); then
        return 1  # would overflow bash arithmetic (64-bit, wrapping: 2^34+1 G is 1 G)
    fi
    printf '%d\n' $((num * mult))
}

meminfo() {  # meminfo FIELD -> bytes
    awk -v f="$1:" '$1 == f { printf "%.0f\n", $2 * 1024; found = 1 } END { exit !found }' /proc/meminfo
}

dataset_bytes() {  # bytes of the shards, side tables and manifest of the dataset in $1
    local dst=$1
    [[ -d $dst ]] || die 1 "--for: '$dst' is not a folder"
    [[ -f $dst/manifest.json ]] ||
        die 1 "--for: '$dst' is not a finished packer dataset (no manifest.json); run packer build first"
    command -v python3 >/dev/null 2>&1 ||
        die 1 "--for needs python3 to read '$dst/manifest.json'; pass --size instead"
    python3 - "$dst/manifest.json" <<'PY' || die 1 "--for: cannot use '$dst/manifest.json'"
import json, os, sys
path = sys.argv[1]
try:
    with open(path, encoding="utf-8") as f:
        man = json.load(f)
    if not isinstance(man, dict) or man.get("format") != "packer":
        raise ValueError("not a packer manifest")
    total = sum(int(s["bytes"]) for s in man["shards"])
    # every side table packer stage copies: labels, offsets, columns, paths
    tables = [man.get("labels"), man.get("offsets")]
    tables += list((man.get("columns") or {}).values()) + list((man.get("paths") or {}).values())
    total += sum(int(t.get("bytes", 0)) for t in tables if t)
except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    sys.exit(f"{path}: {e or type(e).__name__}")
print(total + os.path.getsize(path))
PY
}

# -- arguments ------------------------------------------------------------------------------

size_arg="" for_dst="" dry_run=0 umount=0 fstab=0 noswap=0 mountpoint=""
while (($#)); do
    case $1 in
        -h | --help) help; exit 0 ;;
        --size)
            (($# >= 2)) || usage_error "--size needs a value (e.g. 64G)"
            size_arg=$2; shift 2 ;;
        --size=*) size_arg=${1#*=}; shift ;;
        --for)
            (($# >= 2)) || usage_error "--for needs a dataset folder"
            for_dst=$2; shift 2 ;;
        --for=*) for_dst=${1#*=}; shift ;;
        --dry-run) dry_run=1; shift ;;
        --umount | --unmount) umount=1; shift ;;
        --fstab) fstab=1; shift ;;
        --noswap) noswap=1; shift ;;
        --) shift; break ;;
        -*) usage_error "unknown option '$1'" ;;
        *)
            [[ -z $mountpoint ]] || usage_error "one MOUNTPOINT only (got '$mountpoint' and '$1')"
            mountpoint=$1; shift ;;
    esac
done
while (($#)); do  # after --
    [[ -z $mountpoint ]] || usage_error "one MOUNTPOINT only (got '$mountpoint' and '$1')"
    mountpoint=$1; shift
done

[[ -n $mountpoint ]] || usage_error "MOUNTPOINT is missing"
if [[ -n $size_arg && -n $for_dst ]]; then
    usage_error "give --size or --for, not both"
fi
if ((umount)); then
    if [[ -n $size_arg || -n $for_dst || fstab -eq 1 || noswap -eq 1 ]]; then
        usage_error "--umount takes only MOUNTPOINT (and --dry-run)"
    fi
elif [[ -z $size_arg && -z $for_dst ]]; then
    usage_error "say how big: --size SIZE or --for DST"
fi
# mount and fstab want an absolute, canonical path (symlinks resolved, no trailing /).
mountpoint=$(realpath -m -- "$mountpoint") || usage_error "MOUNTPOINT: cannot resolve '$mountpoint'"

quote() {  # one shell word, quoted only if it needs to be ('...' works in every shell/locale)
    if [[ $1 =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
        printf '%s' "$1"
    else
        local q="'\\''"
        printf "'%s'" "${1//\'/$q}"
    fi
}

run() {  # run a command, or print it under --dry-run
    if ((dry_run)); then
        local sep=""
        for word in "$@"; do
            printf '%s%s' "$sep" "$(quote "$word")"
            sep=" "
        done
        printf '\n'
    else
        "$@"
    fi
}

need_root() {
    if ((EUID != 0 && !dry_run)); then
        die 1 "$1 needs root: run it with sudo (sudo $0 ...). Without root, stage into /dev/shm instead: packer stage DST /dev/shm/NAME"
    fi
}

# What is mounted at MOUNTPOINT now: sets cur_type ("" if nothing), cur_size, cur_used.
cur_type="" cur_size=0 cur_used=0
if [[ -d $mountpoint ]] && mountpoint -q -- "$mountpoint"; then
    cur_type=$(stat -f -c %T -- "$mountpoint")
    read -r bsize blocks bfree < <(stat -f -c '%S %b %f' -- "$mountpoint")
    cur_size=$((bsize * blocks))
    cur_used=$((bsize * (blocks - bfree)))
fi

# -- --umount -------------------------------------------------------------------------------

if ((umount)); then
    if [[ -z $cur_type ]]; then
        echo "nothing mounted at '$mountpoint': nothing to do"
        exit 0
    fi
    [[ $cur_type == tmpfs ]] ||
        die 1 "'$mountpoint' is a $cur_type mount, not a tmpfs; refusing to unmount it"
    need_root "unmounting '$mountpoint'"
    ((dry_run)) || echo "unmounting the tmpfs at '$mountpoint' ($(human "$cur_used") of data in it is discarded)"
    if ! run umount -- "$mountpoint"; then
        die 1 "could not unmount '$mountpoint'; if it is busy, stop what uses it (list: fuser -vm '$mountpoint') and retry"
    fi
    exit 0
fi

# -- the size -------------------------------------------------------------------------------

if [[ -n $for_dst ]]; then
    data=$(dataset_bytes "$for_dst")
    want=$((data + data / 20 + 32 * MIB))
    origin="the dataset in '$for_dst' ($(human "$data")) + 5% + 32 MiB"
else
    want=$(parse_size "$size_arg") || usage_error "--size: '$size_arg' is not a size (examples: 512M, 40G)"
    ((want > 0)) || usage_error "--size must be more than 0"
    origin="--size $size_arg"
fi
mib=$(((want + MIB - 1) / MIB))  # tmpfs sizes are rounded up to whole MiB
want=$((mib * MIB))

opts="size=${mib}m,nosuid,nodev,noatime,mode=0755"
if [[ -n ${SUDO_UID:-} && -n ${SUDO_GID:-} ]]; then
    opts+=",uid=$SUDO_UID,gid=$SUDO_GID"
fi
if ((noswap)); then
    opts+=",noswap"
fi

# -- RAM check ------------------------------------------------------------------------------

total=$(meminfo MemTotal) || die 1 "cannot read MemTotal from /proc/meminfo (is this Linux?)"
avail=$(meminfo MemAvailable) || die 1 "cannot read MemAvailable from /proc/meminfo (Linux 3.14+ has it)"
margin=$((total / 10))
((margin >= 1024 * MIB)) || margin=$((1024 * MIB))
if ((fstab)); then
    # At boot nothing else holds memory yet: check against the machine's RAM.
    room=$((total - margin)) basis="$(human "$total") of RAM in this machine"
    extra=$want
else
    # Growing a tmpfs in place: what it already holds is in RAM already.
    extra=$((want - cur_used))
    room=$((avail - margin)) basis="$(human "$avail") of RAM free now (MemAvailable)"
fi
if ((extra > room)); then
    die 1 "refusing a $(human "$want") tmpfs ($origin): it would not fit in free RAM: $basis, keeping $(human "$margin") as a safety margin, leaves room for $(human "$((room > 0 ? room : 0))"). Free memory, use a smaller --size, or train from the disk copy"
fi

# -- --fstab --------------------------------------------------------------------------------

if ((fstab)); then
    # fstab fields are separated by blanks: write space, tab and backslash as octal escapes.
    field=${mountpoint//\\/\\134}
    field=${field// /\\040}
    field=${field//$'\t'/\\011}
    printf '# packer: tmpfs for %s, %s\n' "$origin" "$(human "$want")"
    printf 'tmpfs\t%s\ttmpfs\t%s\t0\t0\n' "$field" "$opts"
    exit 0
fi

# -- mount ----------------------------------------------------------------------------------

if [[ -n $cur_type ]]; then
    [[ $cur_type == tmpfs ]] ||
        die 1 "'$mountpoint' is already a mount point ($cur_type), not a tmpfs; pick another MOUNTPOINT"
    if ((cur_size >= want)); then
        echo "a tmpfs of $(human "$cur_size") is already mounted at '$mountpoint' ($(human "$cur_used") used; $(human "$want") wanted): nothing to do"
        exit 0
    fi
    need_root "growing the tmpfs at '$mountpoint'"
    ((dry_run)) || echo "growing the tmpfs at '$mountpoint' from $(human "$cur_size") to $(human "$want") (its files are kept)"
    run mount -o "remount,size=${mib}m" -- "$mountpoint"
    exit 0
fi

if [[ -e $mountpoint && ! -d $mountpoint ]]; then
    die 1 "'$mountpoint' exists and is not a folder"
fi
if [[ -d $mountpoint ]] && [[ -n $(ls -A -- "$mountpoint") ]]; then
    die 1 "'$mountpoint' is not empty: a tmpfs mounted there would hide its files; pick an empty or new folder"
fi
need_root "mounting a tmpfs at '$mountpoint'"
if ((!dry_run)); then
    echo "mounting a $(human "$want") tmpfs at '$mountpoint' ($origin)"
fi
[[ -d $mountpoint ]] || run mkdir -p -- "$mountpoint"
run mount -t tmpfs -o "$opts" tmpfs "$mountpoint"
if ((!dry_run)); then
    echo "done. Stage into it with: packer stage DST '$mountpoint/NAME'  (undo: sudo $0 --umount '$mountpoint')"
fi
