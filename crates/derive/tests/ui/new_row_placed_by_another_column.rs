#![allow(dead_code)]

use shardline_repo::Id;

// A comment placed by its photo: its pages of a parent read `photo_id`.
#[derive(shardline_derive::Entity)]
#[shardline(table = "comments")]
struct Comment {
    id: Id,
    #[shardline(parent)]
    photo_id: Id,
    user_id: i64,
    body: String,
}

// Placed by the commenter instead: every comment would land where `page_of_parent`
// never looks.
#[derive(shardline_derive::NewRow)]
#[shardline(entity = Comment)]
struct NewComment {
    photo_id: Id,
    #[shardline(user)]
    user_id: i64,
    body: String,
}

fn main() {}
