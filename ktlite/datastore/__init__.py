"""The data store (kt.put / kt.get): client, on-disk layout, kubernetes pod."""
