"""What an image is and needs: references, the registry client, GPU and libc analysis, the store.

Nothing here imports placement/ or web/.
"""
