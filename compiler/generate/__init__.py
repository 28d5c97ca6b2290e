"""``ctxc generate``: decode with the patch re-solved per step beside the full-context baseline."""
