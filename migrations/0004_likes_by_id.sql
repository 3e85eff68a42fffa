-- Likes are read by their own ID (the repository's get) and paged per photo, newest
-- first: both need an index beside the (photo_id, user_id) key.
CREATE UNIQUE INDEX likes_id ON likes (id);
CREATE INDEX likes_photo_id_id ON likes (photo_id, id DESC);
