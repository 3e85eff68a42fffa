-- Likes live beside the photo they like, in the photo owner's shard.
CREATE TABLE likes (
    photo_id bigint NOT NULL REFERENCES photos (id) ON DELETE CASCADE,
    user_id  bigint NOT NULL,
    id       bigint NOT NULL DEFAULT next_id(),
    PRIMARY KEY (photo_id, user_id)
);
