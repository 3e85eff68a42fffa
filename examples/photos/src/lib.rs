//! The example application shardline's tests, benchmarks and demo run: the Instagram
//! story the product comes from. Users post photos; other users like and comment on
//! them. A photo lives in its owner's shard; its likes and comments live beside it, in
//! the same shard, so a photo's page is one query on one host.
//!
//! The tables are `migrations/0001_photos.sql` to `0004_likes_by_id.sql`; the entities
//! below are all an application writes to use them.
//!
//! # Example
//!
//! ```no_run
//! # async fn photos(config: &shardline_router::Config) -> Result<(), shardline_repo::Error> {
//! use shardline_example_photos::{Comment, NewComment, NewPhoto, Photo};
//! use shardline_repo::{Cluster, ClusterOptions};
//!
//! let cluster = Cluster::connect(config, ClusterOptions::default()).await?;
//! let photo = cluster.repo::<Photo>()?.insert(&NewPhoto::numbered(42, 1)).await?;
//! // The comment lands in the photo's shard, found from the photo's ID alone.
//! let c = NewComment { photo_id: photo.id, user_id: 7, body: "nice".into() };
//! cluster.repo::<Comment>()?.insert(&c).await?;
//! let page = cluster.repo::<Comment>()?.page_of_parent(photo.id, None, 20).await?;
//! assert_eq!(page.rows.len(), 1);
//! # Ok(())
//! # }
//! ```

use shardline_repo::{Entity, Id, NewRow};

#[cfg(feature = "sqlx")]
pub mod with_sqlx;

/// A photo a user posted. With the `sqlx` feature it is also a `sqlx::FromRow`: the same
/// struct is read through the repository or through sqlx ([`shardline_repo::Sqlx`]).
#[derive(Debug, Clone, PartialEq, Eq, Entity)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
#[shardline(table = "photos")]
pub struct Photo {
    /// Minted by the owner's shard.
    pub id: Id,
    /// The owner.
    #[shardline(user)]
    pub user_id: i64,
    /// Where the image is.
    pub url: String,
    /// The caption.
    pub caption: String,
}

/// A photo to post.
#[derive(Debug, Clone, NewRow)]
#[shardline(entity = Photo)]
pub struct NewPhoto {
    /// The owner: the photo goes to their shard.
    #[shardline(user)]
    pub user_id: i64,
    /// Where the image is.
    pub url: String,
    /// The caption.
    pub caption: String,
}

/// A like of a photo, kept in the photo's shard.
#[derive(Debug, Clone, PartialEq, Eq, Entity)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
#[shardline(table = "likes")]
pub struct Like {
    /// Minted by the photo's shard.
    pub id: Id,
    /// The photo liked.
    #[shardline(parent)]
    pub photo_id: Id,
    /// Who liked it.
    pub user_id: i64,
}

/// A like to record.
#[derive(Debug, Clone, NewRow)]
#[shardline(entity = Like)]
pub struct NewLike {
    /// The photo: the like goes to its shard.
    #[shardline(parent)]
    pub photo_id: Id,
    /// Who likes it.
    pub user_id: i64,
}

/// A comment on a photo, kept in the photo's shard.
#[derive(Debug, Clone, PartialEq, Eq, Entity)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
#[shardline(table = "comments")]
pub struct Comment {
    /// Minted by the photo's shard.
    pub id: Id,
    /// The photo answered.
    #[shardline(parent)]
    pub photo_id: Id,
    /// Who wrote it.
    pub user_id: i64,
    /// The text, 1 to 2200 characters.
    pub body: String,
}

/// A comment to post.
#[derive(Debug, Clone, NewRow)]
#[shardline(entity = Comment)]
pub struct NewComment {
    /// The photo: the comment goes to its shard.
    #[shardline(parent)]
    pub photo_id: Id,
    /// Who writes it.
    pub user_id: i64,
    /// The text.
    pub body: String,
}

impl NewPhoto {
    /// A photo of `user_id`, numbered `n`.
    pub fn numbered(user_id: i64, n: u64) -> NewPhoto {
        NewPhoto {
            user_id,
            url: format!("https://cdn.example/{user_id}/{n}.jpg"),
            caption: format!("photo {n}"),
        }
    }
}
