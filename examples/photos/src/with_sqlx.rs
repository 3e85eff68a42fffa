//! The example application's operations written with sqlx (feature `sqlx`), the twin
//! of what it does through the repository: the same tables, the same structs (they
//! derive `sqlx::FromRow` beside `Entity`), routed by [`shardline_repo::Sqlx`].
//!
//! A photo goes to its owner's shard ([`Sqlx::on_user`]); a like or a comment to its
//! photo's shard, found from the photo's ID alone ([`Sqlx::on_id`]).

use shardline_repo::{Error, Id, Sqlx};

use crate::{Comment, Like, NewComment, NewLike, NewPhoto, Photo};

/// Posts a photo in its owner's shard.
///
/// # Errors
///
/// As [`Sqlx::transaction`].
pub async fn post_photo(db: &Sqlx, new: &NewPhoto) -> Result<Photo, Error> {
    db.on_user(new.user_id, |conn| {
        Box::pin(async move {
            sqlx::query_as!(
                Photo,
                r#"INSERT INTO photos (user_id, url, caption) VALUES ($1, $2, $3)
                   RETURNING id AS "id: Id", user_id, url, caption"#,
                new.user_id,
                new.url,
                new.caption
            )
            .fetch_one(&mut **conn)
            .await
        })
    })
    .await
}

/// A photo by its ID, from the shard the ID names.
///
/// # Errors
///
/// As [`Sqlx::on_id`].
pub async fn photo(db: &Sqlx, id: Id) -> Result<Option<Photo>, Error> {
    db.on_id(id, |conn| {
        Box::pin(async move {
            sqlx::query_as!(
                Photo,
                r#"SELECT id AS "id: Id", user_id, url, caption FROM photos WHERE id = $1"#,
                id.as_i64()
            )
            .fetch_optional(&mut **conn)
            .await
        })
    })
    .await
}

/// A user's newest photos, at most `limit`.
///
/// # Errors
///
/// As [`Sqlx::on_user`].
pub async fn photos_of_user(db: &Sqlx, user_id: i64, limit: i64) -> Result<Vec<Photo>, Error> {
    db.on_user(user_id, |conn| {
        Box::pin(async move {
            sqlx::query_as!(
                Photo,
                r#"SELECT id AS "id: Id", user_id, url, caption FROM photos
                   WHERE user_id = $1 ORDER BY id DESC LIMIT $2"#,
                user_id,
                limit
            )
            .fetch_all(&mut **conn)
            .await
        })
    })
    .await
}

/// Likes a photo, in the photo's shard.
///
/// # Errors
///
/// As [`Sqlx::on_id`]; a second like of one photo by one user is a unique violation
/// (`is_unique_violation()`).
pub async fn like(db: &Sqlx, new: &NewLike) -> Result<Like, Error> {
    db.on_id(new.photo_id, |conn| {
        Box::pin(async move {
            sqlx::query_as!(
                Like,
                r#"INSERT INTO likes (photo_id, user_id) VALUES ($1, $2)
                   RETURNING id AS "id: Id", photo_id AS "photo_id: Id", user_id"#,
                new.photo_id.as_i64(),
                new.user_id
            )
            .fetch_one(&mut **conn)
            .await
        })
    })
    .await
}

/// Comments on a photo, in the photo's shard.
///
/// # Errors
///
/// As [`Sqlx::on_id`].
pub async fn comment(db: &Sqlx, new: &NewComment) -> Result<Comment, Error> {
    db.on_id(new.photo_id, |conn| {
        Box::pin(async move {
            sqlx::query_as!(
                Comment,
                r#"INSERT INTO comments (photo_id, user_id, body) VALUES ($1, $2, $3)
                   RETURNING id AS "id: Id", photo_id AS "photo_id: Id", user_id, body"#,
                new.photo_id.as_i64(),
                new.user_id,
                new.body
            )
            .fetch_one(&mut **conn)
            .await
        })
    })
    .await
}
