-- Comments live beside the photo they answer, in the photo owner's shard.
CREATE TABLE comments (
    id       bigint PRIMARY KEY DEFAULT next_id(),
    photo_id bigint NOT NULL REFERENCES photos (id) ON DELETE CASCADE,
    user_id  bigint NOT NULL,
    body     text   NOT NULL CHECK (length(body) BETWEEN 1 AND 2200)
);

CREATE INDEX comments_photo_id_id ON comments (photo_id, id);
