-- Photos a user posted, kept in the shard of user_id % logical_shards.
-- Files here are written unqualified: shardline runs each one with the shard's own
-- schema first on search_path, so next_id() below is this shard's minter.
CREATE TABLE photos (
    id      bigint PRIMARY KEY DEFAULT next_id(),
    user_id bigint NOT NULL,
    url     text   NOT NULL,
    caption text   NOT NULL DEFAULT ''
);

-- A user's photos, newest first, paged by ID (the ID sorts by creation time).
CREATE INDEX photos_user_id_id ON photos (user_id, id DESC);
