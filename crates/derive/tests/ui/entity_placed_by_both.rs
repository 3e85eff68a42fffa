#![allow(dead_code)]

use shardline_repo::Id;

#[derive(shardline_derive::Entity)]
#[shardline(table = "comments")]
struct Comment {
    id: Id,
    #[shardline(parent)]
    photo_id: Id,
    #[shardline(user)]
    user_id: i64,
    body: String,
}

fn main() {}
