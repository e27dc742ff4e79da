# Sourced by the GPU scripts: `scratch_dir DIR` gives the script an empty DIR of its own. DIR is emptied only when
# an hf-zero3 tool made it (the owner file DIR.owner beside it, the convention of hf_zero3/checkpoint/export.py) or
# when it is empty; a folder of that name that is someone's data stops the script, untouched.
scratch_dir() {
  local dir=${1%/}
  if [ -e "$dir" ] || [ -L "$dir" ]; then
    if [ -d "$dir" ] && [ ! -L "$dir" ] && [ -z "$(ls -A "$dir")" ]; then
      rmdir "$dir"
    elif [ -f "$dir.owner" ]; then
      rm -rf "$dir"
    else
      echo "error: $dir exists and was not made by an hf-zero3 script (no $(basename "$dir").owner beside it):" \
           "move it away or point the script at another folder; nothing was deleted" >&2
      return 2
    fi
  fi
  mkdir -p "$dir" && echo "hf-zero3 scratch folder: safe to delete together with the folder of the same name" > "$dir.owner"
}
